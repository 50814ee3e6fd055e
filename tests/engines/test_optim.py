"""An optimizer whose param groups leave out trainable tensors it was given is named in one line,
in every strategy (one process, flat: the check wraps make_optimizer wherever a run is built):
refused when it leaves out all of them, a warning when only some; a tensor frozen by
requires_grad=False may be left out without a word. Across replica groups with FSDP inside it
is in tests/engines/test_inside_fsdp.py."""
from __future__ import annotations

import warnings

import pytest
import torch

import lowcomm
from lowcomm import UsageError
from lowcomm.strategies.registry import available


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _by_names_that_match_nothing(params):
    """Groups picked by names the model does not have (a typo, another model's names)."""
    return torch.optim.AdamW([{"params": [], "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}])


def _without_the_first(params):
    return torch.optim.AdamW(list(params)[1:], lr=1e-2)


@pytest.mark.parametrize("strategy", available())
def test_an_optimizer_holding_none_of_the_tensors_is_refused_in_one_line(strategy):
    with pytest.raises(UsageError) as refused:
        lowcomm.wrap(_model(), _by_names_that_match_nothing, strategy)
    message = str(refused.value)
    assert "leave out 4 of the 4 trainable tensors" in message and "nothing would train" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("strategy", available())
def test_an_optimizer_leaving_out_some_tensors_is_named_in_a_warning(strategy):
    with pytest.warns(UserWarning, match=r"leave out 1 of the 4 trainable tensors .*'0\.weight'") as said:
        lowcomm.wrap(_model(), _without_the_first, strategy).close()
    assert all("\n" not in str(w.message) for w in said)


def test_a_frozen_tensor_may_be_left_out_without_a_word():
    model = _model()
    model[0].weight.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = lowcomm.wrap(model, lambda params: torch.optim.AdamW([p for p in params if p.requires_grad]), "ddp")
    start = model[1].weight.detach().clone()
    with run:
        run.backward(run.model(torch.randn(3, 4)).square().mean())
    assert not torch.equal(model[1].weight, start)
