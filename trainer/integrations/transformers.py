"""Preemption-safe Hugging Face ``transformers.Trainer`` runs (docs/your-trainer.md).

::

    from trainer.integrations.transformers import PreemptionCallback, newest_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[PreemptionCallback()])                               # 1
    trainer = ray.train.huggingface.transformers.prepare_trainer(trainer)
    trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))          # 2

The Trainer does the saving and the resuming (transformers 5.24: ``Trainer._save_checkpoint``
writes ``<output_dir>/checkpoint-<N>/`` with the model, optimizer, LR scheduler, every rank's
RNG state and ``trainer_state.json``; ``train(resume_from_checkpoint=...)`` loads them back
and skips the batches already trained with accelerate's ``skip_first_batches``).  The
callback decides when: at a preemption notice it sets ``control.should_save`` at the step
boundary the ranks agreed on; in ``on_save`` it commits the directory the Trainer wrote as
``<output_dir>/step-<N>/`` with the manifest written last (the layout the daemon counts as
durable), reports it to Ray Train, and, when the deadline plan leaves no room for another step,
holds until Ray tears the workers down.  ``output_dir`` is the checkpoint root: put it on the
shared storage (FSx).

Requires the ``hf`` extra: ``pip install 'resilienced[hf]'``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # the daemon's image and the plain trainer image have no transformers
    raise ImportError(
        "trainer.integrations.transformers needs Hugging Face transformers and accelerate: "
        "install the extra with pip install 'resilienced[hf]'"
    ) from e

from trainer.config import PreemptionConfig
from trainer.errors import UsageError
from trainer.integrations.guard import EventHook, PreemptionGuard, resume_point

__all__ = ["PreemptionCallback", "newest_checkpoint"]

_DEFAULTS = PreemptionConfig()


def newest_checkpoint(output_dir: str | Path) -> str | None:
    """The ``resume_from_checkpoint`` for ``Trainer.train``: the newest ``step-<N>`` under
    ``output_dir`` that verifies against its manifest (None: start afresh).  Collective: call it
    on every rank once the process group is up (Ray Train's train function; after
    ``TrainingArguments`` under torchrun)."""
    point = resume_point(Path(output_dir).resolve())
    return None if point is None else str(point.path)


class PreemptionCallback(TrainerCallback):
    """Saves the step the Trainer is on at a preemption notice; commits every save durably.

    Args:
        keep: committed checkpoints kept under ``output_dir`` (the Trainer's ``save_total_limit``
            does not apply: committed checkpoints are ``step-<N>``, not ``checkpoint-<N>``).
        agree_interval_s, save_margin_factor, save_margin_s, sigterm_grace_s, no_deadline_s,
        teardown_timeout_s: as :class:`trainer.resilience.Checkpointer`'s.
        on_event: ``on_event(name, **fields)`` on every rank (``checkpoint_committed``,
            ``preemption_notice``, ``waiting_for_teardown``).

    Every save the Trainer makes (its own ``save_strategy``, and the ones this callback asks
    for) is committed; the run's last step is always saved (reason ``final``).
    """

    def __init__(
        self,
        *,
        keep: int = 3,
        agree_interval_s: float = 0.5,
        save_margin_factor: float = _DEFAULTS.save_margin_factor,
        save_margin_s: float = _DEFAULTS.save_margin_s,
        sigterm_grace_s: float = _DEFAULTS.sigterm_grace_s,
        no_deadline_s: float = _DEFAULTS.no_deadline_s,
        teardown_timeout_s: float = _DEFAULTS.teardown_timeout_s,
        on_event: EventHook | None = None,
    ) -> None:
        self._make_guard = lambda root: PreemptionGuard(
            root, keep=keep, agree_interval_s=agree_interval_s, on_event=on_event,
            preemption=PreemptionConfig(save_margin_factor=save_margin_factor, save_margin_s=save_margin_s,
                                        sigterm_grace_s=sigterm_grace_s, no_deadline_s=no_deadline_s,
                                        teardown_timeout_s=teardown_timeout_s),
        )
        self._make_guard(".")  # checks the arguments now, not at the first step
        self.guard: PreemptionGuard | None = None
        self._reason: str | None = None  # why this step is saved (None: the Trainer's own save)
        self._decided = time.perf_counter()  # when the save of this step was decided
        self._metrics: dict[str, Any] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if args.save_only_model:
            raise UsageError("PreemptionCallback: save_only_model=True saves no optimizer, LR scheduler or RNG "
                             "state, so a preempted run could not resume exactly; set save_only_model=False")
        if args.ignore_data_skip:
            raise UsageError("PreemptionCallback: ignore_data_skip=True makes a resumed run train its first "
                             "batches again; set ignore_data_skip=False")
        root = Path(args.output_dir).resolve()
        if self.guard is None or self.guard.root != root:
            self.guard = self._make_guard(root)
        self.guard.start(step=state.global_step, resumed=state.global_step > 0)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        assert self.guard is not None
        reason = self.guard.step_end(state.global_step, last=state.global_step >= state.max_steps)
        if reason is not None:
            control.should_save = True  # Trainer._maybe_log_save_evaluate saves right after this hook
        self._reason = reason
        self._decided = time.perf_counter()
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        self._decided = time.perf_counter()  # a save_strategy="epoch" save comes right after this hook
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._metrics = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        return control

    def on_save(self, args, state, control, **kwargs):
        assert self.guard is not None
        step = state.global_step
        written = Path(args.output_dir).resolve() / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        reason, self._reason = self._reason, None
        if self.guard.last_saved == step:  # saved again at the same step (an epoch-end save): keep the first
            self.guard.discard(written)
            return control
        last = step >= state.max_steps
        reason = reason or ("final" if last else "periodic")
        self.guard.committed(written, step=step, reason=reason, started=self._decided,
                             metrics=self._metrics, last=last)
        return control
