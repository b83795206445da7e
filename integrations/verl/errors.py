"""The one error the verl integration raises during a sync: a reason to branch on, the rank it names."""

from __future__ import annotations


class WeightSyncVerlError(RuntimeError):
    """A weight sync of one step did not complete; the rollout keeps the last version it loaded.

    `reason` is machine-readable:
      CONFIG_INVALID         an engine_kwargs entry verl passed is wrong, or unknown (`message` names
                             it; an outcome_host that does not resolve, or is not actor rank 0's
                             host's, at once), or the rollout's node server refused the rollout
                             (a wrong token: `cause_reason` is the server's reason)
      NOT_INITIALIZED        send/receive before verl's init_process_group gave this worker its role
                             and this sync's id (one init_process_group, one send or receive)
      STEP_MISSING           send/receive without global_steps (the version label)
      PUSH_FAILED            a sending actor rank's push failed (`cause_reason`: the server's
                             ErrorInfo reason, or the SDK error's type); raised on every actor rank
                             and on every rollout worker of that sync
      SENDER_LOST            a sending rank's outcome never reached this worker and no sender showed a
                             sign of life (each beats while it sends) for timeout_s, or rank 0's
                             outcome store went away (it died)
      VERSION_NOT_COMMITTED  the push committed, but the rollout's node could not be read within
                             timeout_s of the commit (its server stopped or restarting all that time)
      VERSION_GONE           the rollout's node no longer holds what this sync committed there: it
                             moved on to a later generation, or its store is a new one (its server
                             restarted after the commit)
      ENGINE_FAILED          driver mode: the engine the node's server drives failed to apply the
                             version (the message carries its last_error); it keeps serving its last
      VERSION_NOT_SERVED     driver mode: the engine did not serve the version within timeout_s of
                             its commit
      LORA_UNSUPPORTED       verl handed over a LoRA adapter (its tensors, or its peft_config): refused on
                             every actor rank and every rollout worker before anything is pushed
      GROUP_FAILED           senders "all" over "collective": init_process_group could not make the
                             transfer group of the actor ranks and the servers' workers within the
                             timeout (every actor rank tries again at the next sync)
      ENGINE_NOT_FOUND       driver mode: the node's server drives no engine of that name (or none,
                             or several and engine_kwargs names none)
    `rank` is the actor rank at fault for PUSH_FAILED and SENDER_LOST (with every rank sending: the
    part a server blamed, or one that never joined), else -1;
    `version` is the label asked for ("" when none).
    """

    def __init__(self, reason: str, message: str, *, rank: int = -1, version: str = "",
                 cause_reason: str = "") -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.rank = rank
        self.version = version
        self.cause_reason = cause_reason
