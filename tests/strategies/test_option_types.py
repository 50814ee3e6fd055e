"""A strategy option given as a Python keyword (wrap(), make_run()) is held to its declared type
as the CLI and a TOML file hold it: an on/off option takes True or False, never a string or a
number read as on. In process, W=1: refused before anything is built."""
from __future__ import annotations

import pytest
import torch

import lowcomm
from lowcomm.errors import UsageError


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


@pytest.mark.parametrize("value", ["yes", 1, "true", 0])
@pytest.mark.parametrize("entry", ["wrap", "make_run"])
def test_an_on_off_option_takes_only_a_bool_from_python(entry, value):
    model = torch.nn.Linear(4, 1)
    with pytest.raises(UsageError) as refused:
        if entry == "wrap":
            lowcomm.wrap(model, adamw, strategy="diloco", eager=value, outer_delay=1)
        else:
            lowcomm.make_run("diloco", model, lowcomm.Comm(), adamw, eager=value, outer_delay=1)
    assert str(refused.value) == f"--eager (diloco.eager) must be True or False, got {value!r}"
    assert "\n" not in str(refused.value)


def test_a_bool_is_still_taken_and_other_types_keep_their_checks():
    run = lowcomm.make_run("diloco", torch.nn.Linear(4, 1), lowcomm.Comm(), adamw, eager=True, outer_delay=1,
                           total_steps=8)
    assert run.strategy.options.eager is True
    run.close()
    with pytest.raises(UsageError, match=r"must be an integer, got True"):
        lowcomm.make_run("diloco", torch.nn.Linear(4, 1), lowcomm.Comm(), adamw, sync_every=True)
