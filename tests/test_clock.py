"""The keep-or-revert gate's clock (``gate/clock.py``): where a step's time begins and
ends, its batches' elements, and why a step is left out of the medians (dynamo compiled
in it, or Python collected its oldest generation), on scripted counts and real marks."""

from __future__ import annotations

import gc

import torch
from helpers import elements_of, left_out_of, ms_of

from lightning_regions.gate.clock import COLLECTED_IN_STEP, COMPILED_IN_STEP, StepClock


def test_a_step_is_timed_from_its_first_training_start_to_its_boundary():
    """``StepClock``: a step starts at its first ``training_starts`` after a boundary
    (gradient accumulation calls it again), else at the boundary itself; each ended step
    is one record, of the way its boundary began."""
    clock = StepClock(torch.device("cpu"))
    clock.training_starts()  # before any boundary: no step to start
    assert clock.steps == []
    clock.mark("eager")
    clock.training_starts()
    began = clock.steps[0].start
    clock.training_starts()  # the second micro-batch: the step began at the first
    assert clock.steps[0].start == began
    clock.mark("compiled")
    clock.mark("eager")  # a step without a training start: from its boundary
    first, second = (step.boundary for step in clock.steps[1:])
    assert ms_of(clock) == [1000 * (first - began), 1000 * (second - first)]
    assert [step.way for step in clock.records()] == ["eager", "compiled"]
    assert clock.spans() == [(began, first), (first, second)]


def test_a_step_records_the_elements_of_its_micro_batches():
    """``StepClock.training_starts(batch)``: each call adds its batch's tensors (found
    in tuples, dicts, as Lightning finds them), so a step of accumulated gradients
    counts all its micro-batches; a step given no batch has none."""
    clock = StepClock(torch.device("cpu"))
    clock.mark()
    clock.training_starts(((torch.zeros(4, 3), {"mask": torch.zeros(4)}), 7))
    clock.training_starts([torch.zeros(2, 3), "text"])
    clock.mark()
    clock.mark()
    assert elements_of(clock) == [12 + 4 + 6, None]
    assert clock.shapes() == {((4, 3), (4,)), ((2, 3),)}


def test_a_step_that_compiled_is_marked_from_its_training_start():
    """``StepClock.records``: a step is left out as compiled where the count grew between its
    training's start (or its boundary) and the next boundary; a compile before its
    training started (a validation's, between the boundary and the start) is not its."""
    compiles = [0]
    clock = StepClock(torch.device("cpu"), compiles=lambda: compiles[0])
    clock.mark()
    clock.training_starts()
    compiles[0] += 1  # in the step
    clock.mark()
    compiles[0] += 1  # a validation's compile, before the step's training
    clock.training_starts()
    clock.mark()
    compiles[0] += 1  # no training start: from the boundary
    clock.mark()
    clock.mark()
    assert left_out_of(clock, COMPILED_IN_STEP) == [True, False, True, False]


def test_a_step_in_which_python_collected_its_oldest_generation_is_marked():
    """``StepClock.records``: a step is left out as collected, on Python's own count
    (``full_collections``): a ``gc.collect()`` in a step's training marks it; one before
    its training started (a validation's) does not, nor a young generation's collection."""
    clock = StepClock(torch.device("cpu"))
    clock.mark()
    clock.training_starts()
    gc.collect()
    clock.mark()
    gc.collect()  # between the boundary and the training's start
    clock.training_starts()
    gc.collect(0)
    clock.mark()
    assert left_out_of(clock, COLLECTED_IN_STEP) == [True, False]
    assert left_out_of(clock, COMPILED_IN_STEP) == [False, False]
