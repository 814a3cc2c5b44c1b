"""One resolver for a video request's parameters (taskgate.videoparams): the wire's 0 is the model's default, a stored
request's value is taken as it is, and the limits are the model's."""

from __future__ import annotations

from taskgate import videoparams
from taskgate.config import ModelSpec
from taskgate_api.v1 import task_pb2

SPEC = ModelSpec(
    default_frames=9, default_width=32, default_height=32, default_steps=4, default_guidance=5.0, default_fps=8
)


def test_a_request_that_sets_nothing_gets_the_models_defaults_and_stores_them() -> None:
    params = videoparams.requested(task_pb2.VideoParams(), SPEC)
    assert params == videoparams.defaults(SPEC)
    assert videoparams.stored(params.payload(), SPEC) == params
    assert videoparams.stored({}, SPEC) == params


def test_a_zero_is_the_default_on_the_wire_and_itself_in_a_stored_request() -> None:
    assert videoparams.requested(task_pb2.VideoParams(num_inference_steps=0, fps=0), SPEC).num_inference_steps == 4
    stored = videoparams.stored({"num_inference_steps": 0, "fps": None}, SPEC)
    assert (stored.num_inference_steps, stored.fps) == (0, 8)


def test_the_guidance_is_stored_as_the_float32_meant_it() -> None:
    params = videoparams.requested(task_pb2.VideoParams(guidance_scale=5.1, seed=7), SPEC)
    assert params.payload()["guidance_scale"] == 5.1 and params.seed == 7


def test_each_out_of_range_value_is_named_in_order() -> None:
    params = videoparams.requested(
        task_pb2.VideoParams(num_frames=10, width=33, num_inference_steps=1000, fps=61), SPEC
    )
    assert [field for field, _ in videoparams.violations(params, SPEC, max_fps=60)] == [
        "params.num_frames", "params.width", "params.num_inference_steps", "params.fps",
    ]
    assert videoparams.violations(videoparams.defaults(SPEC), SPEC, max_fps=60) == []
