"""A preemption notice is answered inside a micro-batch: every decoder layer's forward and backward pass checks the
flag (one process), so a step of minutes on a CPU does not hold the notice up; the abandoned step changes nothing
(the resume tests show the result equal to an uninterrupted run's)."""

from __future__ import annotations

import json

import pytest
import torch
from tests.trainruns import TINY_MODEL

from tunecast.step.setup import decoder_layers
from tunecast.step.shape import hf_config
from tunecast.train.signals import Preempted, PreemptionFlag, stop_within_layers


def tiny_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(json.loads((TINY_MODEL / "config.json").read_text())))


def notice_at(layer: torch.nn.Module, flag: PreemptionFlag, *, backward: bool) -> list[str]:
    """Set the flag as `layer` runs its forward (or, with `backward`, its backward) pass; the passes that ran."""
    ran: list[str] = []

    def forward(module: torch.nn.Module, args: object, output: object) -> None:
        ran.append("forward")
        hidden = output[0] if isinstance(output, tuple) else output
        if backward:
            hidden.register_hook(lambda grad: (ran.append("backward"), setattr(flag, "received", "SIGTERM"))[0])
        else:
            flag.received = "SIGTERM"

    layer.register_forward_hook(forward)
    return ran


@pytest.mark.parametrize("backward", [False, True])
def test_a_notice_stops_the_pass_at_the_next_layer(backward: bool) -> None:
    model = tiny_model()
    flag = PreemptionFlag()
    first, second, *_ = decoder_layers(model)
    ran = notice_at(first if not backward else second, flag, backward=backward)
    stop_within_layers(model, flag)
    later = []
    for layer in decoder_layers(model)[2:] if not backward else [first]:
        layer.register_forward_hook(lambda *args: later.append("forward"))
    ids = torch.randint(4, 1000, (2, 32))

    with pytest.raises(Preempted, match="received SIGTERM"):
        model(input_ids=ids, labels=ids).loss.backward()

    assert ran == (["forward", "backward"] if backward else ["forward"])
    assert later == ([] if not backward else ["forward"])  # forward: the layers after it never ran
    if backward:  # the first layer's parameters got no gradient: the pass stopped before reaching it
        assert all(p.grad is None for p in first.parameters())


def test_without_a_notice_the_layers_change_nothing() -> None:
    ids = torch.randint(4, 1000, (2, 32))
    plain, watched = tiny_model(), tiny_model()
    stop_within_layers(watched, PreemptionFlag())
    plain(input_ids=ids, labels=ids).loss.backward()
    watched(input_ids=ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
