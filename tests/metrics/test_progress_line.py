"""The progress line names which model each loss is of where the two differ (the local-SGD
family: the workers' own models train, the global model is validated), as the end summary does."""
from __future__ import annotations

from lowcomm.metrics.progress import ProgressView


def _line(capsys, local_models: bool) -> str:
    view = ProgressView(10, "run", enabled=True, local_models=local_models)
    view.update(10, 3.21, 1000.0, 1.0, 0.1, val_loss=4.55)
    return capsys.readouterr().out.strip()


def test_a_local_sgd_line_says_whose_loss_each_figure_is(capsys):
    line = _line(capsys, local_models=True)
    assert "own-model loss 3.210" in line and "global-model val_loss 4.5500" in line


def test_a_single_model_line_keeps_its_plain_words(capsys):
    line = _line(capsys, local_models=False)
    assert "  loss 3.210" in line and "  val_loss 4.5500" in line and "model" not in line
