"""A debug session around transformers' `Trainer`: a callback that calls `debug_api.step()` at each optimizer step's
end (``on_step_end``; with gradient accumulation the micro-batches of one optimizer step are one iteration) is all
it takes.  The session changes nothing the Trainer computes, and each optimizer step is one logged iteration."""

from __future__ import annotations

import pytest
import torch

import tedebug
from tedebug import debug_api

from support.features import RecordingSink, debug_session, section
from support.hf_models import VOCAB, llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # (the Trainer's own requirement; in the test extra)

pytestmark = pytest.mark.filterwarnings("ignore")  # (the Trainer's deprecation and device notes)

STEPS, ACCUMULATE = 3, 2


class _StepAtOptimizerStep(transformers.TrainerCallback):
    """The README's callback."""

    def on_train_begin(self, args, state, control, **kwargs):
        debug_api.initialize_training_step(state.global_step)  # (a resumed run goes on from its step)

    def on_step_end(self, args, state, control, **kwargs):
        debug_api.step()


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class _PausedEvaluation(transformers.Trainer):
    """The README's Trainer: its evaluations run inside `debug_api.paused()`."""

    def evaluate(self, *args, **kwargs):
        with debug_api.paused():
            return super().evaluate(*args, **kwargs)


def _train(out_dir, callbacks, inputs_seen=None, trainer_class=None, resume=None, **arguments):
    """The Trainer's losses over STEPS optimizer steps of ACCUMULATE micro-batches, on a converted tiny Llama;
    `inputs_seen` (a list) gets the max of q_proj's input at each forward."""
    torch.manual_seed(0)
    model = tedebug.convert_model(llama())
    if inputs_seen is not None:
        q_proj = model.model.layers[0].self_attn.q_proj
        q_proj.register_forward_pre_hook(lambda module, args: inputs_seen.append(args[0].max().item()))
    args = transformers.TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **{"max_steps": STEPS, "save_strategy": "no", **arguments},
    )
    trainer = (trainer_class or transformers.Trainer)(
        model=model, args=args, train_dataset=_Tokens(), eval_dataset=_Tokens(), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_a_session_under_the_trainer_logs_each_optimizer_step_and_changes_nothing(tmp_path, no_debug_session):
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": 1}})
    sink, seen = RecordingSink(), []
    with debug_session(config, tmp_path / "logs", sink=sink, default_logging_enabled=True):
        losses = _train(tmp_path / "a", [_StepAtOptimizerStep()], seen)
    assert losses == _train(tmp_path / "b", []) and len(losses) == STEPS
    values = sink.values()  # (a statistic emitted twice for one iteration fails here)
    layers = 7  # q, k, v, o, gate, up, down (lm_head stays in high precision and is not debugged)
    assert sorted({iteration for _, iteration in values}) == list(range(STEPS))
    assert len(values) == layers * STEPS
    # an iteration's max is over its ACCUMULATE micro-batches, and only those
    assert len(seen) == STEPS * ACCUMULATE
    for step in range(STEPS):
        want = max(seen[step * ACCUMULATE : (step + 1) * ACCUMULATE])
        assert values[("model.layers.0.self_attn.q_proj_activation_max", step)] == pytest.approx(want, rel=0, abs=0)


def test_evaluations_inside_paused_stay_out_of_the_statistics(tmp_path, no_debug_session):
    """An evaluation after every step (`eval_strategy="steps"`) runs after the step callback: without the README's
    `paused()` its forwards count in the next iteration's statistics, with it the statistics are those of a run
    without evaluations."""
    config = section({"LogTensorStats": {"enabled": True, "stats": ["l1_norm"], "tensors": ["activation"], "freq": 1}})

    def statistics(name, **kw):
        sink = RecordingSink()
        with debug_session(config, tmp_path / name, sink=sink, default_logging_enabled=True):
            _train(tmp_path / f"{name}-out", [_StepAtOptimizerStep()], **kw)
        return sink.values()

    plain = statistics("plain")
    evaluated = dict(eval_strategy="steps", eval_steps=1)
    assert statistics("paused", trainer_class=_PausedEvaluation, **evaluated) == plain
    counted = statistics("counted", **evaluated)
    key = ("model.layers.0.self_attn.q_proj_activation_l1_norm", 1)
    assert counted[key] > plain[key]


def test_a_resumed_run_logs_the_trainers_step_numbers(tmp_path, no_debug_session):
    """The callback sets the iteration to the Trainer's step when training begins, so a run resumed from a
    checkpoint at step 2 logs its next step as iteration 2, as the Trainer counts it."""
    _train(tmp_path / "first", [], save_strategy="steps", save_steps=2, max_steps=2)
    config = section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": 1}})
    sink = RecordingSink()
    with debug_session(config, tmp_path / "logs", sink=sink, default_logging_enabled=True):
        _train(tmp_path / "first", [_StepAtOptimizerStep()], resume=tmp_path / "first" / "checkpoint-2")
    assert sorted({iteration for _, _, iteration in sink.rows}) == list(range(2, STEPS))
