"""Setting a recipe key on a RunConfig. A recipe spells a setting as config.toml does
(`steps`, `[model] n_layer`, `[quantized] bits`), as its flag does without the dashes
(`lr`, `n_layer`, `warmup`, `model = "tiny"`, `link = "100mbit,10ms"`), or as a bare
strategy option (`bits`): whichever a user has at hand reads the same."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Iterator

from ... import config as C
from ...config.flags import RUN_FLAGS
from ...strategies import available
from ...strategies import get as get_strategy

# A flag's name, dashes as underscores, -> its config key, where the two differ (lr -> optim.lr).
ALIASES = {name[2:].replace("-", "_"): flag.key for name, flag in RUN_FLAGS.items()
           if name[2:].replace("-", "_") != flag.key}
LINKS = ("link", "intra_link")  # "BW,LAT[,JIT]" as one string, as --link takes it


def flatten(table: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """{'model': {'n_layer': 2}} -> ('model.n_layer', 2): TOML tables as dotted keys."""
    for key, value in table.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def canonical(key: str) -> str:
    """The config key a recipe key sets ('lr' and 'optim.lr' are one setting; 'powersgd_rank',
    as its flag --powersgd-rank is spelt, and 'rank' are one option)."""
    return ALIASES.get(key) or option_aliases().get(key, key)


def option_aliases() -> dict[str, str]:
    """A strategy option's flag name, dashes as underscores, -> its field, where the two differ."""
    from ...strategies import option_table
    return {flag[2:].replace("-", "_"): opt.field for flag, opt in option_table().items()
            if flag[2:].replace("-", "_") != opt.field}


def apply(cfg: C.RunConfig, key: str, value: Any) -> None:
    """Set one recipe key (UsageError naming it when it is no setting or its value is bad)."""
    if key in LINKS and isinstance(value, str):
        C.set_link(cfg, value, key, key)
    else:
        C.set_value(cfg, canonical(key), value, name=key)


def strategy_of(key: str) -> str | None:
    """The strategy a key belongs to: '<strategy>.<option>' keys name it; None for the others."""
    head, _, rest = key.partition(".")
    return head if rest and head in available() else None


def applies_to(key: str, strategy: str) -> bool:
    """Whether a key set for every run reaches `strategy`: run settings reach all, a strategy
    option only the strategies that declare it, a '[<strategy>]' key only that one."""
    owner = strategy_of(key)
    if owner is not None:
        return owner == strategy
    key = canonical(key)
    if key in option_fields() and canonical(key) not in {f.name for f in fields(C.RunConfig)}:
        return key in {f.name for f in fields(get_strategy(strategy).Options)}
    return True


def option_fields() -> set[str]:
    """Every registered strategy's option names."""
    return {f.name for name in available() for f in fields(get_strategy(name).Options)}


def owners(key: str) -> list[str]:
    """The strategies that have option `key` (bare, or '<strategy>.<option>')."""
    name = key.partition(".")[2] if strategy_of(key) else canonical(key)
    return [s for s in available() if name in {f.name for f in fields(get_strategy(s).Options)}]
