"""The end of a failed run's line says what a rerun continues from, and a fix that continues from it."""

from __future__ import annotations

from ddp_recipes.checkpointing import kept

HOW = "once the store answers"


def test_the_line_names_the_checkpoint_a_rerun_continues_from():
    kept.reset()
    assert kept.current().words(HOW) is None  # nothing trained: the failure says enough
    kept.started(None, 0)
    assert kept.current().words(HOW) == ("training stopped before its first checkpoint (none was saved): rerun the "
                                         f"same command {HOW}")
    kept.saved("run/checkpoints/last.ckpt", 12)
    assert kept.current().words(HOW).endswith(f"kept (run/checkpoints/last.ckpt, step 12): rerun with --resume auto "
                                              f"{HOW}")


def test_a_checkpoint_resumed_from_another_folder_is_continued_by_the_same_command_not_resume_auto():
    """--resume PATH into a new --output-dir, stopped before its first save: --resume auto there would start from
    step 0; the same command resumes from PATH again."""
    kept.reset()
    kept.started("pretrain/checkpoints/last.ckpt", 500, own=False)
    words = kept.current().words(HOW)
    assert "--resume auto" not in words and words.endswith(f"(pretrain/checkpoints/last.ckpt, step 500): rerun the "
                                                           f"same command {HOW}"), words
    kept.started("run/checkpoints/last.ckpt", 500, own=True)  # --resume auto of its own folder
    assert kept.current().words(HOW).endswith(f"rerun with --resume auto {HOW}")
    kept.reset()
