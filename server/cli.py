"""`weightsync-server`: start the server (also `weightsync serve`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from weightsync.common.logging import configure_logging
from weightsync.server.config import build_parser, check_devices, config_from_args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--ready-file", default="")
    known, rest = extra.parse_known_args(argv)
    try:
        config = config_from_args(rest)
        check_devices(config.devices)
    except (ValueError, OSError) as error:
        print(f"weightsync-server: {error}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    from weightsync.server.app import serve

    try:
        return asyncio.run(serve(config, ready_file=known.ready_file))
    except (OSError, TimeoutError) as error:
        reason = str(error) or f"{type(error).__name__} (the workers did not start; see the log above)"
        print(f"weightsync-server: {reason}", file=sys.stderr)
        return 1


__all__ = ["main", "build_parser"]

if __name__ == "__main__":
    sys.exit(main())
