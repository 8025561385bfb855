"""A pass option the driver resolves by the cost model (`lower-topk{strategy=auto}`,
`schedule-experts{order=auto}`): tcpc compile and tcpc run simulate each choice and write the
cheapest into the pipeline before the pass runs (tcpc/program.py), so the pass itself only
checks the value and refuses `auto`."""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.utils.exceptions import PassFailedException

AUTO = "auto"


def check_choice(pass_name: str, option: str, value: str, choices: Sequence[str]) -> None:
    """A ValueError naming the pass, the option and its values when `value` is none of them."""
    if value not in (*choices, AUTO):
        raise ValueError(f"{pass_name}: unknown {option} '{value}' (choose {', '.join(choices)} or {AUTO})")


def refuse_auto(pass_name: str, option: str, value: str, choices: Sequence[str]) -> None:
    """Fail the pass when asked to run with `option=auto`, which only the driver resolves."""
    if value == AUTO:
        raise PassFailedException(
            f"{pass_name}{{{option}=auto}} is chosen by the cost model, which tcpc compile and tcpc run apply "
            f"before the pass runs; here give {option}={f' or {option}='.join(choices)}")
