"""The one error the verl integration raises during a sync: a reason to branch on, the rank it names."""

from __future__ import annotations


class WeightSyncVerlError(RuntimeError):
    """A weight sync of one step did not complete; the rollout keeps the last version it loaded.

    `reason` is machine-readable:
      CONFIG_INVALID         an engine_kwargs entry verl passed is wrong (`message` names it)
      NOT_INITIALIZED        send/receive before verl's init_process_group gave this worker its role
      STEP_MISSING           send/receive without global_steps (the version label)
      PUSH_FAILED            a sending actor rank's push failed (`cause_reason`: the server's
                             ErrorInfo reason, or the SDK error's type); raised on every actor rank
                             and on every rollout worker waiting for that version
      SENDER_LOST            a sending rank's outcome (or, with every rank sending, rank 0's update
                             key) never reached this worker within the timeout, or rank 0's outcome
                             store went away (it died)
      VERSION_NOT_COMMITTED  the rollout's node did not commit the asked version within the timeout
                             (or its server could not be reached all that time: stopped, restarting)
      VERSION_GONE           the rollout's node already holds a later step than the one asked for
      ENGINE_FAILED          driver mode: the engine the node's server drives failed to apply the
                             version (the message carries its last_error); it keeps serving its last
      VERSION_NOT_SERVED     driver mode: the engine did not serve the version within the timeout
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
