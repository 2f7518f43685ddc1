"""Triton's walk of an ensemble's data flow (ensemble_steps.decoupled_flow): whether a decoupled
step's responses make the ensemble decoupled, and the refusal of a step (or the outputs) fed by
two different decoupled steps, in Triton's words."""
from __future__ import annotations

from google.protobuf import text_format

from shmserve.server.broker.config import mc
from shmserve.server.broker.ensemble_steps import decoupled_flow


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def model(name: str, decoupled: bool, inputs: tuple[str, ...] = ("IN",), outputs: tuple[str, ...] = ("OUT",)):
    tensors = lambda names: ", ".join(f'{{ name: "{n}" data_type: TYPE_INT32 dims: [ 1 ] }}' for n in names)
    return config(f'name: "{name}" backend: "python" input [ {tensors(inputs)} ] output [ {tensors(outputs)} ] '
                  f'model_transaction_policy {{ decoupled: {str(decoupled).lower()} }}')


def ensemble(name: str, steps: str, inputs=("X",), outputs=("Y",)) -> mc.ModelConfig:
    tensors = lambda names: ", ".join(f'{{ name: "{n}" data_type: TYPE_INT32 dims: [ 1 ] }}' for n in names)
    return config(f'name: "{name}" platform: "ensemble" input [ {tensors(inputs)} ] output [ {tensors(outputs)} ] '
                  f'ensemble_scheduling {{ {steps} }}')


def step(model_name: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    ins = ", ".join(f'{{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = ", ".join(f'{{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'step {{ model_name: "{model_name}" input_map [ {ins} ] output_map [ {outs} ] }}'


MODELS = {"dec": model("dec", True), "plain": model("plain", False),
          "join": model("join", False, inputs=("A", "B"))}


def test_plain_steps_are_not_decoupled():
    e = ensemble("e", step("plain", {"IN": "X"}, {"OUT": "t"}) + step("plain", {"IN": "t"}, {"OUT": "Y"}))
    assert decoupled_flow(e, MODELS) == (False, None)


def test_decoupled_steps_in_series_or_a_dead_end_make_it_decoupled():
    series = ensemble("e", step("dec", {"IN": "X"}, {"OUT": "t"}) + step("dec", {"IN": "t"}, {"OUT": "Y"}))
    assert decoupled_flow(series, MODELS) == (True, None)
    dead_end = ensemble("e", step("plain", {"IN": "X"}, {"OUT": "Y"}) + step("dec", {"IN": "X"}, {"OUT": "unused"}))
    assert decoupled_flow(dead_end, MODELS) == (True, None)


def test_a_step_fed_by_two_decoupled_origins_is_refused():
    e = ensemble("e", step("dec", {"IN": "X"}, {"OUT": "a"}) + step("dec", {"IN": "X"}, {"OUT": "b"})
                 + step("join", {"A": "a", "B": "b"}, {"OUT": "Y"}))
    assert decoupled_flow(e, MODELS)[1] == ("in ensemble e, step of model 'e' receives inputs originated from "
                                            "different decoupled models")
    # A decoupled lineage joined with the request's own tensors is refused too (named, as by
    # Triton, after the model its output tensor was first seen with).
    e = ensemble("e", step("dec", {"IN": "X"}, {"OUT": "a"}) + step("join", {"A": "a", "B": "X"}, {"OUT": "t"})
                 + step("plain", {"IN": "t"}, {"OUT": "Y"}))
    assert decoupled_flow(e, MODELS)[1] == ("in ensemble e, step of model 'join' receives inputs originated from "
                                            "different decoupled models")


def test_a_nested_ensemble_is_decoupled_by_its_own_steps():
    inner = ensemble("inner", step("dec", {"IN": "X"}, {"OUT": "Y"}))
    outer = ensemble("outer", step("inner", {"X": "X"}, {"Y": "Y"}))
    assert decoupled_flow(outer, {**MODELS, "inner": inner}) == (True, None)
