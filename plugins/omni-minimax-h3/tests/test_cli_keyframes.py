"""`omni generate --image` for a video: the first frame (and a second image the last), as /v1/videos'
``input_reference`` and ``last_frame``; an image sent in a chat message says where it belongs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omni_core.errors import InvalidRequestError

MODEL = "omni-tiny/minimax-h3"
INLINE = ["--set", "encoder.placement=inline", "--set", "dit.placement=inline"]


def _generate(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from omni_cli.main import cli

    result = CliRunner().invoke(cli, ["generate", MODEL, "--prompt", "a cat", *args])
    return result.exit_code, result.output


def _png(path: Path, width: int, height: int) -> str:
    from PIL import Image

    Image.new("RGB", (width, height), (20, 30, 200)).save(path)
    return str(path)


def test_an_image_is_the_first_frame(tmp_path: Path) -> None:
    tall = _png(tmp_path / "tall.png", 32, 64)  # (the tiny checkpoint's own canvas is 64x32)
    # A file whose name gives no type (a data:application/octet-stream URL) is read by its bytes.
    nameless = tmp_path / "frame"
    nameless.write_bytes(Path(tall).read_bytes())
    params = json.dumps({"dit": {"num_inference_steps": 2}})
    code, output = _generate("--image", str(nameless), "--image", tall, "--stage-params", params, "--json", *INLINE)
    assert code == 0, output
    video = json.loads(output[output.index("{\n"):])["video"]
    assert video["shape"][1:] == [64, 32, 3]  # the canvas follows the first frame's shape


def test_more_than_two_images_are_refused_before_loading(tmp_path: Path) -> None:
    image = _png(tmp_path / "a.png", 8, 8)
    code, output = _generate("--image", image, "--image", image, "--image", image)
    assert code != 0 and "a video takes at most two --image files (its first and last frames), got 3" in output, output


def test_an_image_in_a_chat_message_names_the_keyframe_fields(processor) -> None:
    from omni_core.engine.request import OmniRequest

    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "a cat"}]
    with pytest.raises(InvalidRequestError) as info:
        processor.process(OmniRequest(messages=[{"role": "user", "content": content}]))
    assert info.value.param == "messages[0].content[0]"
    assert str(info.value) == (
        "messages[0].content[0]: this model takes no image in a chat message (the part is of type 'image_url'; it reads text); "
        "MiniMax-H3 takes its first and last frames as the request's image and last_image fields "
        "(/v1/videos: input_reference and last_frame; omni generate: --image, once or twice)"
    )


def _decoded(path: str) -> tuple[np.ndarray, np.ndarray]:
    """An MP4's video frames and audio samples, decoded."""
    import av

    with av.open(path) as container:
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    with av.open(path) as container:
        audio = np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=-1)
    return frames, audio


def test_references_are_the_video_requests_references(tmp_path: Path, pipeline) -> None:
    """``--reference`` files (an image, then audio: typed by name, or by the image's header when the
    name says nothing) make the ref2va request /v1/videos' references would: the same MP4 as that
    request run offline, and not the one without them."""
    import soundfile

    from omni_core.engine.offline import Omni
    from omni_core.engine.request import OmniRequest
    from omni_cli.commands import _data_url

    face = tmp_path / "face"  # (a PNG named without an extension)
    face.write_bytes(Path(_png(tmp_path / "face.png", 40, 40)).read_bytes())
    voice = tmp_path / "voice.wav"
    soundfile.write(voice, np.random.default_rng(0).uniform(-0.3, 0.3, (8000, 2)).astype(np.float32), 8000)
    params = {"dit": {"num_inference_steps": 2, "seed": 3, "size": [32, 32]}}
    code, output = _generate("--reference", str(face), "--reference", str(voice), "--stage-params", json.dumps(params), "--out", str(tmp_path / "cli"), "--json", *INLINE)
    assert code == 0, output
    from_cli = _decoded(json.loads(output[output.index("{\n"):])["video"]["path"])

    references = [{"type": "image", "image": _data_url(face)}, {"type": "audio", "audio": _data_url(voice)}]
    with Omni(pipeline) as omni:
        alone, without = omni.generate([OmniRequest(prompt="a cat", params=params, extra={"references": references}), OmniRequest(prompt="a cat", params=params)])
    expected, other = (_decoded(result.save(tmp_path / name)["video"]) for result, name in ((alone, "alone"), (without, "without")))
    assert np.array_equal(from_cli[0], expected[0]) and np.array_equal(from_cli[1], expected[1])
    assert not np.array_equal(from_cli[0], other[0])


def test_a_reference_for_a_model_that_makes_no_video_is_refused(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from omni_cli.main import cli

    image = _png(tmp_path / "a.png", 8, 8)
    result = CliRunner().invoke(cli, ["generate", "omni-tiny/hunyuan-image3", "--prompt", "a cat", "--reference", image])
    assert result.exit_code != 0 and "--reference is a video's reference" in result.output and "use --image" in result.output, result.output


def test_a_reference_named_without_a_type_is_told_by_its_header(tmp_path: Path) -> None:
    """An image header, even one declaring more pixels than PIL opens (a decompression bomb), makes an
    image reference, for the request to refuse by its pixel limit; other bytes make audio."""
    import struct
    import zlib

    from omni_cli.commands import _reference

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    huge = tmp_path / "huge"
    huge.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 40000, 40000, 8, 2, 0, 0, 0)) + chunk(b"IEND", b""))
    small = tmp_path / "small"
    small.write_bytes(Path(_png(tmp_path / "s.png", 8, 8)).read_bytes())
    noise = tmp_path / "noise"
    noise.write_bytes(b"RIFF" + bytes(64))
    assert [_reference(path)["type"] for path in (huge, small, noise)] == ["image", "image", "audio"]

