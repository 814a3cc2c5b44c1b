"""The model families: each pipeline class's rules and defaults fill the registry, and submit refuses what they
forbid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from services.submit.validation import validate
from taskgate import errors
from taskgate.config import ModelSpec, Settings, load_settings
from taskgate.families import FAMILIES, TEXT_TO_VIDEO, family_of
from taskgate_api.v1 import gateway_pb2, task_pb2
from tests.support.harness import ROOT, details_of

PIPELINES = sorted(FAMILIES)
# The submit tests send text requests; image-to-video ones need an input image (tests of the submit side's own).
TEXT_PIPELINES = sorted(p for p, f in FAMILIES.items() if f.task_type == TEXT_TO_VIDEO)


def settings_with(spec: ModelSpec) -> Settings:
    """Settings whose only (and default) model is `spec`; validation needs no server."""
    return Settings(database_url="postgresql://unused", nats_url="nats://unused", models={"m": spec}, default_model="m")


async def refused_fields(settings: Settings, **params: Any) -> set[str]:
    """The fields an INVALID_ARGUMENT names for a request with these params (empty when it is accepted)."""
    request = gateway_pb2.SubmitTaskRequest(prompt="a cat runs", params=task_pb2.VideoParams(**params))
    try:
        await validate("tenant", request, settings)
    except errors.ApiError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
        bad = next(d for d in details_of(exc.status_proto) if isinstance(d, error_details_pb2.BadRequest))
        return {v.field for v in bad.field_violations}
    return set()


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_family_fills_what_the_entry_leaves_out(pipeline: str) -> None:
    family = FAMILIES[pipeline]
    spec = ModelSpec(path=Path("/models/x"), pipeline=pipeline)
    for name, value in family.spec_defaults().items():
        assert getattr(spec, name) == value, name
    own = ModelSpec(pipeline=pipeline, max_frames=family.max_frames + family.frame_step, default_steps=7)
    assert (own.max_frames, own.default_steps, own.frame_step) == (
        family.max_frames + family.frame_step,
        7,
        family.frame_step,
    )


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_family_defaults_obey_the_family_rules(pipeline: str) -> None:
    family = FAMILIES[pipeline]
    assert (family.default_frames - 1) % family.frame_step == 0 and family.default_frames <= family.max_frames
    assert (family.max_frames - 1) % family.frame_step == 0
    for size in (family.default_width, family.default_height, family.max_width, family.max_height):
        assert size % family.size_multiple == 0


@pytest.mark.parametrize("pipeline", TEXT_PIPELINES)
async def test_submit_accepts_the_family_defaults_and_edges(pipeline: str) -> None:
    family = FAMILIES[pipeline]
    settings = settings_with(ModelSpec(pipeline=pipeline))
    sub = await validate("tenant", gateway_pb2.SubmitTaskRequest(prompt="a cat runs"), settings)
    expected = (
        family.default_frames,
        family.default_width,
        family.default_height,
        family.default_steps,
        family.default_fps,
    )
    assert (sub.payload["num_frames"], sub.payload["width"], sub.payload["height"], sub.payload["num_inference_steps"],
            sub.payload["fps"]) == expected
    assert sub.payload["guidance_scale"] == family.default_guidance
    edges = {"num_frames": family.max_frames, "width": family.max_width, "height": family.size_multiple,
             "num_inference_steps": family.max_steps, "guidance_scale": family.max_guidance}
    assert await refused_fields(settings, **edges) == set()
    assert await refused_fields(settings, num_frames=1 + family.frame_step) == set()


@pytest.mark.parametrize("pipeline", TEXT_PIPELINES)
async def test_submit_refuses_what_the_family_cannot_make_naming_the_field(pipeline: str) -> None:
    family = FAMILIES[pipeline]
    settings = settings_with(ModelSpec(pipeline=pipeline))
    m, step = family.size_multiple, family.frame_step
    cases: list[tuple[dict[str, Any], str]] = [
        ({"num_frames": 1 + step + step // 2}, "params.num_frames"),  # off the family's frame arithmetic
        ({"num_frames": family.max_frames + step}, "params.num_frames"),
        ({"width": m + m // 2}, "params.width"),  # not a multiple of the family's size multiple
        ({"height": m + m // 2}, "params.height"),
        ({"width": family.max_width + m}, "params.width"),
        ({"num_inference_steps": family.max_steps + 1}, "params.num_inference_steps"),
        ({"guidance_scale": family.max_guidance + 1}, "params.guidance_scale"),
    ]
    for params, field in cases:
        assert await refused_fields(settings, **params) == {field}, params


@pytest.mark.parametrize("pipeline", TEXT_PIPELINES)
async def test_a_negative_prompt_only_where_the_family_uses_one(pipeline: str) -> None:
    family = FAMILIES[pipeline]
    settings = settings_with(ModelSpec(pipeline=pipeline))
    refused = await refused_fields(settings, negative_prompt="blurry")
    assert refused == (set() if family.negative_prompt else {"params.negative_prompt"})
    # An operator who turns on real CFG (HunyuanVideo: true_cfg_scale) lets it through.
    enabled = settings_with(
        ModelSpec(pipeline=pipeline, negative_prompt=True, pipeline_options={"guidance_rescale": 0.0})
    )
    assert await refused_fields(enabled, negative_prompt="blurry") == set()


def test_the_table_differs_where_the_families_do() -> None:
    assert {FAMILIES[p].size_multiple for p in PIPELINES} == {16, 32}
    assert {FAMILIES[p].frame_step for p in PIPELINES} == {4, 8}
    assert not FAMILIES["HunyuanVideoPipeline"].negative_prompt
    assert family_of(None) is None and family_of("MochiPipeline") is None


def test_an_unknown_pipeline_keeps_the_generic_rules() -> None:
    spec = ModelSpec(pipeline="MochiPipeline", frame_step=6, default_frames=7)
    assert (spec.frame_step, spec.size_multiple, spec.default_frames) == (6, 16, 7)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"pipeline": "LTXPipeline", "default_width": 48}, "default_width 48 is not a multiple of size_multiple 32"),
        ({"pipeline": "CogVideoXPipeline", "default_frames": 13}, "default_frames 13 breaks"),
        ({"default_steps": 0}, "default_steps 0"),
        ({"pipeline": "CogVideoXPipeline", "attention_backend": "flash"}, "does not honour attention_backend"),
        ({"pipeline": "CogVideoXPipeline", "torch_compile": "blocks"}, "no repeated blocks"),
        ({"pipeline_options": {"num_frames": 9}}, "may not set num_frames"),
        ({"vae_tilling": True}, "Extra inputs are not permitted"),
        ({"offload": "disk"}, "offload"),
        ({"gpus": [-1]}, "greater than or equal to 0"),
    ],
)
def test_an_entry_the_worker_could_not_honour_is_refused_at_start(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ModelSpec.model_validate(fields)


def test_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(
        "TASKGATE_MODELS", '{"ltx": {"path": "/models/ltx", "pipeline": "LTXPipeline", "default_width": 48}}'
    )
    monkeypatch.setenv("TASKGATE_DEFAULT_MODEL", "ltx")
    with pytest.raises(SystemExit):
        load_settings()
    assert "TASKGATE_MODELS" in capsys.readouterr().err
    monkeypatch.setenv(
        "TASKGATE_MODELS", '{"ltx": {"path": "/models/ltx", "pipeline": "LTXPipeline", "offload": "model"}}'
    )
    spec = load_settings().models["ltx"]
    assert (spec.size_multiple, spec.frame_step, spec.offload, spec.default_fps) == (32, 8, "model", 25)


def test_the_readme_examples_are_valid_entries_of_every_family() -> None:
    readme = (ROOT / "docs" / "models.md").read_text()
    section = readme.split("### Models", 1)[1]
    example = json.loads(section.split("```json", 1)[1].split("```", 1)[0])
    specs = {name: ModelSpec.model_validate(entry) for name, entry in example.items()}
    assert set(TEXT_PIPELINES) <= {spec.pipeline for spec in specs.values()} <= set(FAMILIES)
    load_settings(models=specs, default_model="wan")
