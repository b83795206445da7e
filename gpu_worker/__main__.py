"""Entry point of a worker process: `python -m weightsync.gpu_worker`.

The server starts it with a fresh interpreter (the spawn model: nothing
inherited but the file descriptors it names). The config arrives as a
serialized WorkerConfig on the command line; the two queues and the fd channel
(a unix socket to the server) as inherited file descriptors: no pickle
crosses the process boundary.

Exit status: 0 after shutdown or when the server is gone; EXIT_DEVICE_FAULT
or EXIT_DEVICE_LOST (device_faults.py) when the CUDA device is unusable.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import sys
import threading

import structlog


def _die_with_parent() -> None:
    """Linux: get SIGKILL if the server dies, so no worker is ever orphaned."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync-worker")
    parser.add_argument("--config-hex", required=True)
    parser.add_argument("--command-fds", required=True, help="segment_fd,doorbell_fd")
    parser.add_argument("--event-fds", required=True, help="segment_fd,doorbell_fd")
    args = parser.parse_args(argv)

    _die_with_parent()
    # Ctrl-C reaches the whole process group; the server decides how we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from weightsync.common import numba_cache, patch_kernels
    from weightsync.common.logging import configure_logging, get_logger
    from weightsync.common.shm_queue import AttachedQueue
    from weightsync.gpu_worker.worker import Worker
    from weightsync.worker.v1 import worker_pb2

    config = worker_pb2.WorkerConfig()
    config.ParseFromString(bytes.fromhex(args.config_hex))
    configure_logging(config.log_level or "info")
    structlog.contextvars.bind_contextvars(worker=config.index)
    if os.getppid() != config.parent_pid:
        return 1
    cmd_seg, cmd_bell = (int(x) for x in args.command_fds.split(","))
    evt_seg, evt_bell = (int(x) for x in args.event_fds.split(","))
    commands = AttachedQueue(cmd_seg, cmd_bell)
    events = AttachedQueue(evt_seg, evt_bell)
    import torch

    from weightsync.common.nccl_env import worker_environment
    from weightsync.gpu_worker.device_faults import DeviceFault, classify

    # NCCL groups of this process: no torch watchdog or monitor, our timeouts decide (common/nccl_env.py).
    # Set once, here, before any thread or group exists.
    os.environ.update(worker_environment(os.environ))
    # One intra-op thread: copies and checksums are memory-bound, and OpenMP
    # barriers stall when the host's cores are busy with the broadcast.
    torch.set_num_threads(1)
    if config.device.startswith("cuda"):
        # NCCL binds to the current device; buffers and checksums stay on it.
        try:
            torch.cuda.set_device(torch.device(config.device))
            torch.cuda.mem_get_info(torch.device(config.device))  # touches the device: fails here if it is gone
        except Exception as error:  # noqa: BLE001 - classified, then the exit status says it
            fault = classify(error) or DeviceFault.LOST
            get_logger("weightsync.worker").error("device_unusable_at_start", device=config.device,
                                                            error=str(error)[:300], exit_code=fault.exit_code)
            sys.stderr.flush()
            os._exit(fault.exit_code)
    fd_channel = socket.socket(fileno=config.fd_channel) if config.fd_channel > 0 else None
    worker = Worker(config, commands.queue, events.queue, fd_channel)
    # The kernels are loaded from numba's cache in a thread (about a second), so the first patched bucket finds
    # them loaded; once the server's child process compiled them into it (common/numba_cache.py): compiling
    # here would hold the interpreter's lock long enough to stop this worker's heartbeat.
    def load_kernels() -> None:
        numba_cache.wait_compiled()  # bounded; past it, the kernels compile here as they load (as without it)
        patch_kernels.warm_up_in_background()

    threading.Thread(target=load_kernels, name="weightsync-kernels-compiled", daemon=True).start()
    code = worker.run(parent_alive=lambda: os.getppid() == config.parent_pid)
    commands.close()
    events.close()
    # Everything is released; skip interpreter teardown (torch's can take
    # seconds on a loaded host and would eat into the server's grace period).
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
