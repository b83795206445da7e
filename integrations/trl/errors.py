"""The one error the integration raises while training: a reason to branch on, a message to read."""

from __future__ import annotations


class WeightSyncTrlError(RuntimeError):
    """A weight sync did not complete; vLLM keeps serving the last version it took (STAGED: all or nothing).

    `reason` is machine-readable:
      VLLM_BACKEND_MISSING  vLLM was started without --weight-transfer-config '{"backend": "weightsync"}'
      DTYPE_UNKNOWN         vLLM serves a dtype the integration cannot cast to: set WeightSyncConfig(dtype=...)
      ENGINE_NOT_FOUND      the weightsync server does not drive the vLLM that TRL generates with
      SERVER_UNREACHABLE    the weightsync server did not answer (down, restarting, wrong address)
      PUSH_FAILED           the server refused or aborted the update (`cause_reason`: its ErrorInfo reason)
      ENGINE_FAILED         vLLM refused the committed version (`detail`: what the server reported)
      ENGINE_TIMEOUT        vLLM did not serve the committed version within the timeout
      PREFIX_CACHE_NOT_RESET  vLLM kept refusing to drop its prefix cache within the timeout
    """

    def __init__(self, reason: str, message: str, *, cause_reason: str = "", code: str = "") -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.cause_reason = cause_reason
        """The weightsync server's ErrorInfo reason (PUSH_FAILED, SERVER_UNREACHABLE), if any."""
        self.code = code
        """The gRPC status code's name, if a server answered with one."""
