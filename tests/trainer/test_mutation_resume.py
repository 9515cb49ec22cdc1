"""``--resume`` restores the task cursor (issue 37): restoring it as 0 handed out tasks that were
already trained (cursor 5 instead of 14) and no test read ``task_cursor`` after a resume, the crash
tests included. In-process: a trainer set up, tasks drawn, a checkpoint saved; a second trainer
set up with ``resume=True`` must hand out the next task, not the first again."""

from __future__ import annotations

from trainer_jax.config import load_config

TINY = ["sft.steps=0", "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
        "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=16",
        "service.listen=127.0.0.1:0"]


def _trainer(tmp_path, resume: bool):
    from trainer_jax.train import Trainer

    trainer = Trainer(load_config(None, [f"run.dir={tmp_path / 'run'}", *TINY]), resume=resume)
    trainer._setup()
    return trainer


def test_resume_hands_out_the_task_after_the_saved_cursor(tmp_path):
    first = _trainer(tmp_path, resume=False)
    drawn = [first.source.next_task() for _ in range(14)]
    assert first.source.cursor == 14
    first.meta["step"] = 3
    first._save_checkpoint()
    upcoming = first.source.next_task()
    first.checkpointer.close()

    resumed = _trainer(tmp_path, resume=True)
    assert resumed.restored and resumed.meta["step"] == 3 and resumed.meta["task_cursor"] == 14
    assert resumed.source.cursor == 14
    again = resumed.source.next_task()
    assert (again.prompt_ids, again.payload) == (upcoming.prompt_ids, upcoming.payload)
    # (the seeded stream's task 14 differs from task 0: a cursor restored as 0 would repeat it)
    assert (again.prompt_ids, again.payload) != (drawn[0].prompt_ids, drawn[0].payload)
    resumed.checkpointer.close()
