"""The contract every model family passes, reusable by third-party family plugins.

Subclass `FamilyContract` in the plugin's tests under a ``Test*`` name, name the family and keep
it small and fast::

    from omni_core.testing.family_contract import FamilyContract

    class TestMyFamily(FamilyContract):
        family = "myfamily"
        deploy = {"stages": {"llm": {"placement": "inline"}}}   # what the engine runs
        params = {"llm": {"max_tokens": 8, "temperature": 0.0}}  # every valid request: short, greedy
        tolerance = {"audio": 1e-5}                              # batched vs alone, where not exact

What it checks, on a checkpoint written by the family's own ``make_tiny``:

- `resolve` turns the checkpoint into the family's pipeline;
- ``Omni(...).generate`` returns every modality the pipeline declares (one request per entry of
  `modality_sets`, for families that cannot produce them all at once);
- bad input (`bad_requests`) raises `InvalidRequestError`, and the engine keeps serving;
- three different requests sent together give what each gives alone: token ids exactly, media
  arrays within `tolerance` (exactly by default). Sampling must be deterministic: greedy, or
  seeded (`valid_request` gives each request its seed).

One engine serves a whole test class (class-scoped fixtures); override `valid_request`,
`bad_requests` or `plugins` where the defaults do not fit. Needs numpy (``pip install
'omni-core[testing]'``), plus whatever the family itself needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pytest

from omni_core.config.modelref import read_hf_config
from omni_core.config.resolve import resolve
from omni_core.config.resolved import ResolvedPipeline
from omni_core.engine.request import OmniRequest
from omni_core.errors import InvalidRequestError
from omni_core.refs import load_ref

if TYPE_CHECKING:
    from omni_core.engine.offline import Omni
    from omni_core.engine.result import OmniResult
    from omni_core.plugins import PluginHost

    Baseline = dict[tuple[tuple[str, ...], int], OmniResult]
    """Results of requests run alone, by (modalities, index)."""

PROMPTS = (
    "Once upon a time there was a little robot",
    "The weather today is sunny with a gentle breeze",
    "Please describe the picture: a red apple on a table",
)
"""Default prompts of `FamilyContract.valid_request` (request ``index`` takes ``PROMPTS[index]``)."""


# -- what a result must hold -----------------------------------------------------------------------


def assert_has_modality(result: OmniResult, modality: str, what: str = "result") -> None:
    """`result` holds a non-empty output of `modality` (``text``, ``audio``, ``image``, ``video``, ``action``)."""
    if modality == "text":
        assert result.token_ids or result.text, f"{what}: no text (neither token ids nor text)"
    elif modality == "audio":
        assert result.audio is not None and result.audio.size > 0, f"{what}: no audio"
        assert result.sample_rate, f"{what}: audio without a sample_rate"
    elif modality == "image":
        assert result.images, f"{what}: no image"
        for image in result.images:
            assert np.asarray(image).ndim == 3, f"{what}: an image must be [height, width, channels]"
    elif modality == "video":
        assert result.video is not None, f"{what}: no video"
        assert np.asarray(result.video).ndim == 4, f"{what}: a video must be [frames, height, width, channels]"
        assert result.fps, f"{what}: video without fps"
    elif modality == "action":
        assert result.actions is not None, f"{what}: no actions"
    else:
        raise ValueError(f"unknown modality {modality!r}")


def assert_same_result(
    actual: OmniResult, expected: OmniResult, tolerance: Mapping[str, float] | None = None, what: str = "result"
) -> None:
    """Equal outputs: text and token ids exactly, media arrays within ``tolerance[modality]`` (absolute)."""
    tolerance = tolerance or {}
    assert actual.prompt_token_ids == expected.prompt_token_ids, f"{what}: prompt token ids differ"
    assert actual.token_ids == expected.token_ids, f"{what}: token ids {actual.token_ids} != {expected.token_ids}"
    assert actual.text == expected.text, f"{what}: text {actual.text!r} != {expected.text!r}"
    assert actual.finish_reason == expected.finish_reason, f"{what}: finish_reason differs"
    assert actual.sample_rate == expected.sample_rate and actual.fps == expected.fps, f"{what}: sample_rate or fps differs"
    _assert_arrays(actual.audio, expected.audio, tolerance.get("audio", 0.0), f"{what}: audio")
    assert len(actual.images) == len(expected.images), f"{what}: {len(actual.images)} images != {len(expected.images)}"
    for index, (got, want) in enumerate(zip(actual.images, expected.images)):
        _assert_arrays(got, want, tolerance.get("image", 0.0), f"{what}: image {index}")
    _assert_arrays(actual.video, expected.video, tolerance.get("video", 0.0), f"{what}: video")
    _assert_arrays(actual.actions, expected.actions, tolerance.get("action", 0.0), f"{what}: actions")


def _assert_arrays(actual: Any, expected: Any, atol: float, what: str) -> None:
    if expected is None:
        assert actual is None, f"{what}: present here, absent in the other"
        return
    assert actual is not None, f"{what}: absent here, present in the other"
    if isinstance(expected, list):  # several samples (e.g. actions of n samples)
        assert isinstance(actual, list) and len(actual) == len(expected), f"{what}: sample counts differ"
        for index, (got, want) in enumerate(zip(actual, expected)):
            _assert_arrays(got, want, atol, f"{what}[{index}]")
        return
    got, want = _numpy(actual), _numpy(expected)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    # Integer media (uint8 pixels) compare as signed numbers: no wrap-around in the difference.
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=atol, err_msg=what)


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    return np.asarray(value)


# -- the suite --------------------------------------------------------------------------------------


class FamilyContract:
    """Contract tests of a model family; subclass it under a ``Test*`` name (see the module doc)."""

    family: ClassVar[str]
    """The registered family name (`PipelineFamily.name`)."""
    size: ClassVar[str] = "tiny"
    """The size passed to the family's ``make_tiny``."""
    deploy: ClassVar[Mapping[str, Any] | None] = None
    """Deploy settings over the family's defaults (a raw mapping, as a deploy file holds)."""
    overrides: ClassVar[tuple[str, ...]] = ()
    """``--set`` overrides, applied last."""
    params: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    """Per-stage parameters of every valid request (keep outputs short; make sampling deterministic)."""
    modality_sets: ClassVar[tuple[tuple[str, ...], ...]] = ()
    """The modalities of each request that together cover the pipeline's; empty: one request for all."""
    concurrent_modalities: ClassVar[tuple[str, ...] | None] = None
    """The modalities of the three concurrent requests; None: the first modality set."""
    tolerance: ClassVar[Mapping[str, float]] = {}
    """Absolute tolerance per media modality (``audio``, ``image``, ``video``, ``action``) between a
    request run alone and the same request run with others; 0 (exact) where not named."""

    # -- hooks --------------------------------------------------------------------------------------

    @classmethod
    def plugins(cls) -> PluginHost:
        """The plugins the family is found in: the installed ones."""
        from omni_core.plugins import default_plugins

        return default_plugins()

    def valid_request(self, modalities: tuple[str, ...], index: int) -> OmniRequest:
        """A valid request for `modalities`; `index` (0, 1, 2) must give different outputs."""
        return OmniRequest(
            prompt=PROMPTS[index % len(PROMPTS)],
            modalities=modalities,
            params={stage: dict(values) for stage, values in self.params.items()},
        )

    def bad_requests(self) -> dict[str, OmniRequest]:
        """Requests the family must reject with `InvalidRequestError`, by label."""
        params = {stage: dict(values) for stage, values in self.params.items()}
        return {"no prompt and no messages": OmniRequest(params=params)}

    # -- fixtures (one checkpoint and one engine per test class) ------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """A checkpoint written by the family's own ``make_tiny`` (what ``omni make-tiny`` runs)."""
        family = cls.plugins().families.get(cls.family)
        assert family is not None, f"no installed plugin registers the family {cls.family!r}"
        assert family.make_tiny is not None, f"family {cls.family!r} registers no make_tiny"
        directory = tmp_path_factory.mktemp(f"{cls.family}-tiny")
        load_ref(family.make_tiny)(directory, cls.size)
        return directory

    @pytest.fixture(scope="class")
    @classmethod
    def pipeline(cls, tiny_checkpoint: Path) -> ResolvedPipeline:
        return resolve(str(tiny_checkpoint), deploy=cls.deploy, overrides=cls.overrides, plugins=cls.plugins())

    @pytest.fixture(scope="class")
    @classmethod
    def omni(cls, pipeline: ResolvedPipeline) -> Iterator[Omni]:
        from omni_core.engine.offline import Omni

        with Omni(pipeline) as engine:
            yield engine

    @pytest.fixture(scope="class")
    @classmethod
    def alone(cls) -> Baseline:
        """Results of requests run on their own, by (modalities, index), filled by `run_alone`."""
        return {}

    def run_alone(self, omni: Omni, alone: Baseline, modalities: tuple[str, ...], index: int) -> OmniResult:
        """The result of `valid_request(modalities, index)` run with no other request in flight."""
        key = (modalities, index)
        if key not in alone:
            (alone[key],) = omni.generate(self.valid_request(modalities, index))
        return alone[key]

    def requested_sets(self, pipeline: ResolvedPipeline) -> tuple[tuple[str, ...], ...]:
        return self.modality_sets or (pipeline.modalities,)

    # -- the checks -----------------------------------------------------------------------------------

    def test_make_tiny_checkpoint_resolves_to_the_family(self, tiny_checkpoint: Path, pipeline: ResolvedPipeline) -> None:
        host = self.plugins()
        assert host.family_for(str(tiny_checkpoint), read_hf_config(tiny_checkpoint)).name == self.family
        assert pipeline.family == self.family
        assert pipeline.stages and any(stage.final for stage in pipeline.stages), "a pipeline needs a final stage"
        declared = set(pipeline.modalities)
        assert declared, "the pipeline declares no output modality"
        assert set(pipeline.default_modalities) <= declared, f"default modalities {pipeline.default_modalities} not produced"
        requested = [set(modalities) for modalities in self.requested_sets(pipeline)]
        for modalities in requested:
            assert modalities <= declared, f"modality_sets: {sorted(modalities - declared)} not produced by {sorted(declared)}"
        assert set().union(*requested) == declared, f"modality_sets leave out {sorted(declared - set().union(*requested))}"

    def test_generate_returns_every_declared_modality(self, omni: Omni, pipeline: ResolvedPipeline, alone: Baseline) -> None:
        for modalities in self.requested_sets(pipeline):
            result = self.run_alone(omni, alone, modalities, 0)
            for modality in modalities:
                assert_has_modality(result, modality, f"request for {', '.join(modalities)}")

    def test_bad_input_raises_invalid_request_error_and_the_engine_keeps_serving(
        self, omni: Omni, pipeline: ResolvedPipeline, alone: Baseline
    ) -> None:
        bad = self.bad_requests()
        assert bad, "bad_requests() must name at least one request the family rejects"
        for label, request in bad.items():
            with pytest.raises(InvalidRequestError):
                omni.generate(request)
                pytest.fail(f"bad request {label!r} was served")
        modalities = self.requested_sets(pipeline)[0]
        expected = self.run_alone(omni, alone, modalities, 0)
        (again,) = omni.generate(self.valid_request(modalities, 0))
        assert_same_result(again, expected, self.tolerance, "the same request after the bad ones")

    def test_three_concurrent_requests_equal_each_alone(
        self, omni: Omni, pipeline: ResolvedPipeline, alone: Baseline
    ) -> None:
        modalities = self.concurrent_modalities or self.requested_sets(pipeline)[0]
        expected = [self.run_alone(omni, alone, modalities, index) for index in range(3)]
        together = omni.generate([self.valid_request(modalities, index) for index in range(3)])
        for index, (got, want) in enumerate(zip(together, expected)):
            assert_same_result(got, want, self.tolerance, f"request {index} sent with two others vs alone")
        # Different requests, or equality would prove nothing about keeping requests apart.
        assert not _all_same(expected), "valid_request(modalities, 0..2) must give different outputs"


def _all_same(results: list[OmniResult]) -> bool:
    first = results[0]
    for other in results[1:]:
        try:
            assert_same_result(other, first)
        except AssertionError:
            return False
    return True


__all__ = ["PROMPTS", "FamilyContract", "assert_has_modality", "assert_same_result"]
