"""convert.safetensors_io interoperates with the reference safetensors implementation."""

import ml_dtypes
import numpy as np
import pytest

from convert.safetensors_io import SafetensorsError, SafetensorsFile, write_file

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

TORCH_OF = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(np.float32): torch.float32,
            np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn, np.dtype(np.uint8): torch.uint8,
            np.dtype(np.int8): torch.int8, np.dtype(np.float16): torch.float16}


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "w.bf16": rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
        "w.f32": rng.standard_normal((3,)).astype(np.float32),
        "w.fp8": rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn),
        "w.u8": rng.integers(0, 255, (2, 9), dtype=np.uint8),
        "w.i8": rng.integers(-127, 127, (6, 1), dtype=np.int8),
        "w.f16": rng.standard_normal((2, 2)).astype(np.float16),
        "scalar": np.asarray(0.5, np.float32).reshape(()),
    }


def test_our_files_load_with_safetensors_torch(tmp_path):
    arrays = _arrays()
    write_file(tmp_path / "a.safetensors", arrays, {"format": "pt"})
    loaded = st_torch.load_file(tmp_path / "a.safetensors")
    assert set(loaded) == set(arrays)
    for name, arr in arrays.items():
        t = loaded[name]
        assert t.dtype == TORCH_OF[arr.dtype] and tuple(t.shape) == arr.shape
        assert t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() == arr.tobytes()


def test_safetensors_torch_files_load_with_ours(tmp_path):
    arrays = _arrays()
    tensors = {n: torch.frombuffer(bytearray(a.tobytes()), dtype=TORCH_OF[a.dtype]).reshape(a.shape)
               for n, a in arrays.items()}
    st_torch.save_file(tensors, tmp_path / "b.safetensors", metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "b.safetensors")
    assert f.metadata == {"format": "pt"} and set(f.keys()) == set(arrays)
    for name, arr in arrays.items():
        got = f.get(name)
        assert got.dtype == arr.dtype and got.shape == arr.shape and got.tobytes() == arr.tobytes()


def test_truncated_file_is_refused_with_its_name(tmp_path):
    path = tmp_path / "c.safetensors"
    write_file(path, _arrays())
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(SafetensorsError, match="c.safetensors.*truncated"):
        SafetensorsFile(path)


def test_hash_while_writing_equals_the_file_hash(tmp_path):
    import hashlib

    h = hashlib.sha256()
    path = tmp_path / "d.safetensors"
    write_file(path, _arrays(), {"format": "pt"}, hasher=h)
    assert h.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
