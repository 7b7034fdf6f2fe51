"""roundpipe.safetensors against an independent reader and writer written here
from the format description (struct, json and torch.frombuffer only):

    8 bytes: little-endian u64 N, the header's length
    N bytes: UTF-8 JSON {name: {"dtype", "shape", "data_offsets": [begin, end]},
             "__metadata__": {str: str} (optional)}, may be padded with spaces
    rest:    the data region; each tensor's bytes [begin, end), row-major,
             little-endian

Files written by roundpipe open in the independent reader with identical
tensors; files of the independent writer load in roundpipe; malformed files
raise ValueError with a clear message.
"""
import json
import os
import pathlib
import struct

import pytest
import torch

from roundpipe import safetensors as st

# ---------------------------------------------------------------------------
# The independent implementation

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def read_independently(path):
    """(tensors, metadata or None, N, the header's raw bytes, the JSON keys in file order)."""
    data = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw_header = data[8:8 + n]
    header = json.loads(raw_header.decode("utf-8"))
    keys = list(header)
    metadata = header.pop("__metadata__", None)
    buffer = data[8 + n:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        assert 0 <= begin <= end <= len(buffer)
        dtype = DTYPES[info["dtype"]]
        if begin == end:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(bytearray(buffer[begin:end]), dtype=dtype).reshape(info["shape"])
    return tensors, metadata, n, raw_header, keys


def tensor_bytes(t):
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def write_independently(path, tensors, metadata=None, order=None, align=True, indent=None):
    """Writes tensors in `order` (default: sorted names); `align` pads the
    header with spaces so the data region starts at a multiple of 8."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    blobs, offset = [], 0
    for name in order if order is not None else sorted(tensors):
        t = tensors[name]
        blob = tensor_bytes(t)
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, indent=indent).encode("utf-8")
    if align:
        text += b" " * (-len(text) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return header


def assert_same(got, want):
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype, name
        assert tuple(g.shape) == tuple(t.shape), name
        assert torch.equal(g, t.detach().cpu()), name


def every_dtype():
    g = torch.Generator().manual_seed(0)
    return {
        "f64": torch.randn(3, 4, dtype=torch.float64, generator=g),
        "f32": torch.randn(5, generator=g),
        "f16": torch.randn(2, 3, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "i64": torch.randint(-10 ** 12, 10 ** 12, (2, 2), generator=g),
        "i32": torch.randint(-10 ** 6, 10 ** 6, (3,), dtype=torch.int32, generator=g),
        "i16": torch.randint(-30000, 30000, (5,), dtype=torch.int16, generator=g),
        "i8": torch.randint(-128, 128, (9,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 256, (3, 1, 2), dtype=torch.uint8, generator=g),
        "bool": torch.randint(0, 2, (6,), generator=g).bool(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "empty_i8": torch.empty(4, 0, dtype=torch.int8),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
    }


# ---------------------------------------------------------------------------
# roundpipe -> independent reader

def test_files_written_by_roundpipe_open_in_the_independent_reader(tmp_path):
    tensors = every_dtype()
    metadata = {"format": "pt", "note": "ünïcode \"quoted\""}
    st.save_file(tensors, tmp_path / "m.safetensors", metadata=metadata)

    got, got_metadata, n, raw_header, keys = read_independently(tmp_path / "m.safetensors")
    assert_same(got, tensors)
    assert got_metadata == metadata
    # Layout: the data region starts at a multiple of 8, the header is padded
    # with spaces, "__metadata__" comes first, then the tensors by element
    # size (largest first) and name, tiling the data region.
    assert (8 + n) % 8 == 0
    text = raw_header.rstrip(b" ")
    assert text.startswith(b"{") and text.endswith(b"}") and len(raw_header) - len(text) < 8
    assert keys[0] == "__metadata__"
    header = json.loads(raw_header)
    names = keys[1:]
    assert names == sorted(names, key=lambda k: (-SIZES[header[k]["dtype"]], k))
    offset = 0
    for name in names:
        begin, end = header[name]["data_offsets"]
        assert begin == offset
        assert begin % SIZES[header[name]["dtype"]] == 0
        offset = end
    assert 8 + n + offset == os.path.getsize(tmp_path / "m.safetensors")


def test_non_contiguous_and_autograd_inputs_are_written_as_their_values(tmp_path):
    base = torch.arange(60.0).reshape(6, 10)
    tensors = {
        "transposed": base.t(),
        "strided": base[:, 1::3],
        "row": base[4],
        "expanded": torch.arange(3, dtype=torch.int32).expand(4, 3),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "grad_result": torch.ones(3, requires_grad=True) * 2,
    }
    st.save_file(tensors, str(tmp_path / "v.safetensors"))
    got, metadata, _, _, _ = read_independently(tmp_path / "v.safetensors")
    assert metadata is None
    assert_same(got, tensors)
    loaded = st.load_file(tmp_path / "v.safetensors")
    assert_same(loaded, tensors)
    assert all(t.is_contiguous() and not t.requires_grad for t in loaded.values())


def test_no_tensors(tmp_path):
    st.save_file({}, tmp_path / "e.safetensors")
    got, metadata, n, raw_header, _ = read_independently(tmp_path / "e.safetensors")
    assert got == {} and metadata is None and raw_header == b"{}      "
    assert st.load_file(tmp_path / "e.safetensors") == {}


# ---------------------------------------------------------------------------
# independent writer -> roundpipe

@pytest.mark.parametrize("order", ["sorted", "reversed", "by_size"])
@pytest.mark.parametrize("align", [True, False])
def test_files_of_the_independent_writer_load_in_roundpipe(tmp_path, order, align):
    tensors = every_dtype()
    names = sorted(tensors)
    if order == "reversed":
        names = names[::-1]
    elif order == "by_size":
        names = sorted(names, key=lambda k: -tensors[k].element_size())
    path = tmp_path / "w.safetensors"
    header = write_independently(path, tensors, metadata={"who": "test"}, order=names, align=align, indent=1)
    loaded = st.load_file(path)
    assert_same(loaded, tensors)
    # In the order of the bytes (empty tensors sharing an offset: by name).
    assert list(loaded) == sorted(names, key=lambda k: (*header[k]["data_offsets"], k))
    assert st.load_metadata(path) == {"who": "test"}


def test_misaligned_tensors_are_read_correctly(tmp_path):
    tensors = {"a": torch.tensor([7], dtype=torch.uint8), "b": torch.tensor([1.5, -2.0], dtype=torch.float64)}
    path = tmp_path / "odd.safetensors"
    write_independently(path, tensors, order=["a", "b"], align=True)  # "b" begins at byte 1
    assert_same(st.load_file(path), tensors)


def test_loaded_tensors_are_copy_on_write_views(tmp_path):
    path = tmp_path / "c.safetensors"
    write_independently(path, {"w": torch.zeros(1024)})
    before = path.read_bytes()
    w = st.load_file(path)["w"]
    w.add_(1)
    assert torch.equal(w, torch.ones(1024))
    assert path.read_bytes() == before
    assert torch.equal(st.load_file(path)["w"], torch.zeros(1024))


def test_tensors_outlive_a_replaced_or_removed_file(tmp_path):
    path = tmp_path / "r.safetensors"
    st.save_file({"w": torch.zeros(16)}, path)
    old = st.load_file(path)["w"]
    st.save_file({"w": torch.ones(16)}, path)
    assert torch.equal(old, torch.zeros(16))
    new = st.load_file(path)["w"]
    path.unlink()
    assert torch.equal(new, torch.ones(16))


# ---------------------------------------------------------------------------
# Errors

def test_invalid_arguments_and_tensors(tmp_path):
    path = tmp_path / "keep.safetensors"
    st.save_file({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(TypeError, match="tensor names must be str"):
        st.save_file({1: torch.ones(1)}, path)
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        st.save_file({"a": [1, 2]}, path)
    with pytest.raises(TypeError, match="metadata must map str to str"):
        st.save_file({"a": torch.ones(1)}, path, metadata={"k": 1})
    with pytest.raises(TypeError, match="metadata must be a dict"):
        st.save_file({"a": torch.ones(1)}, path, metadata=[("k", "v")])
    with pytest.raises(TypeError, match="tensors must be a dict"):
        st.save_file([("a", torch.ones(1))], path)
    with pytest.raises(ValueError, match="ComplexFloat.*cannot store"):
        st.save_file({"z": torch.ones(2, dtype=torch.complex64)}, path)
    with pytest.raises(ValueError, match="reserved for the metadata"):
        st.save_file({"__metadata__": torch.ones(1)}, path)
    with pytest.raises(ValueError, match="only dense tensors"):
        st.save_file({"s": torch.ones(2, 2).to_sparse()}, path)
    with pytest.raises(ValueError, match="has no data"):
        st.save_file({"m": torch.empty(2, device="meta")}, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["keep.safetensors"]  # no temporary file left


def test_system_errors_raise_runtime_error(tmp_path):
    with pytest.raises(RuntimeError, match="cannot open .*missing.safetensors"):
        st.load_file(tmp_path / "missing.safetensors")
    with pytest.raises(RuntimeError, match="not a regular file"):
        st.load_file(tmp_path)
    # A file that cannot be written: OSError with its errno and filename.
    with pytest.raises(FileNotFoundError, match="cannot create") as info:
        st.save_file({"a": torch.ones(1)}, tmp_path / "no" / "such" / "dir.safetensors")
    assert info.value.filename == str(tmp_path / "no" / "such" / "dir.safetensors")


def frame(header, data=b""):
    """A file from header text (str or bytes) and data, with a correct length."""
    if isinstance(header, str):
        header = header.encode("utf-8")
    return struct.pack("<Q", len(header)) + header + data


def entry(name, dtype, shape, offsets):
    return f'"{name}": {{"dtype": "{dtype}", "shape": {shape}, "data_offsets": {offsets}}}'


F2 = struct.pack("<2f", 1.0, 2.0)  # 8 bytes of data
A = entry("a", "F32", "[2]", "[0, 8]")

MALFORMED = [
    ("empty file", b"", "fewer than the 8"),
    ("truncated length", b"\x02\x00\x00\x00", "has 4 bytes"),
    ("header longer than the file", struct.pack("<Q", 100) + b"{}", "header length 100 exceeds the 2 bytes"),
    ("huge header length", struct.pack("<Q", 100_000_001) + b"{}", "exceeds the limit of 100000000"),
    ("header length 2^64-1", struct.pack("<Q", 2 ** 64 - 1) + b"{}", "exceeds the limit"),
    ("invalid JSON", frame('{"a": '), "not valid UTF-8 JSON"),
    ("trailing garbage", frame("{} x"), "not valid UTF-8 JSON"),
    ("NUL padding", frame(b"{}\x00\x00"), "NUL byte at offset 2"),
    ("invalid UTF-8", frame(b'{"\xff": 1}'), "not valid UTF-8 JSON"),
    ("not an object", frame("[]"), "must be a JSON object, got array"),
    ("entry not an object", frame('{"a": 3}'), 'tensor "a": the entry must be an object'),
    ("missing dtype", frame('{"a": {"shape": [], "data_offsets": [0, 0]}}'), 'missing field "dtype"'),
    ("missing shape", frame('{"a": {"dtype": "F32", "data_offsets": [0, 0]}}'), 'missing field "shape"'),
    ("missing offsets", frame('{"a": {"dtype": "F32", "shape": []}}'), 'missing field "data_offsets"'),
    ("dtype not a string", frame('{"a": {"dtype": 4, "shape": [], "data_offsets": [0, 4]}}'),
     '"dtype" must be a string'),
    ("unknown dtype", frame("{" + entry("a", "F33", "[2]", "[0, 8]") + "}", F2), 'unknown dtype "F33"'),
    ("shape not an array", frame('{"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}', F2),
     '"shape" must be an array'),
    ("negative shape", frame("{" + entry("a", "F32", "[-2]", "[0, 8]") + "}", F2),
     r"shape\[0\] must be an integer in \[0, 2\^63\), got -2"),
    ("fractional shape", frame("{" + entry("a", "F32", "[2.5]", "[0, 8]") + "}", F2), "must be an integer"),
    ("shape overflowing int64", frame("{" + entry("a", "F32", "[4294967296, 4294967296]", "[0, 8]") + "}", F2),
     "overflows int64"),
    ("empty shape with huge strides",
     frame("{" + entry("a", "F32", "[0, 4611686018427387904, 4611686018427387904]", "[0, 0]") + "}"),
     "overflows int64"),
    ("one offset", frame("{" + entry("a", "F32", "[2]", "[8]") + "}", F2),
     r'"data_offsets" must be \[begin, end\]'),
    ("negative offset", frame("{" + entry("a", "F32", "[2]", "[-8, 0]") + "}", F2), r'"data_offsets" must be'),
    ("begin after end", frame("{" + entry("a", "F32", "[2]", "[8, 0]") + "}", F2), "begin is after end"),
    ("offsets out of range", frame("{" + entry("a", "F32", "[4]", "[0, 16]") + "}", F2),
     r"data_offsets \[0, 16\] lie outside the data region, which has 8 bytes"),
    ("huge end", frame("{" + entry("a", "F32", "[2]", "[0, 18446744073709551615]") + "}", F2),
     "lie outside the data region"),
    ("wrong byte size", frame("{" + entry("a", "F32", "[2, 2]", "[0, 8]") + "}", F2),
     r"hold 8 bytes, but shape \[2, 2\] of dtype F32 needs 16 bytes"),
    ("overlapping tensors", frame("{" + A + ", " + entry("b", "F32", "[1]", "[4, 8]") + "}", F2),
     r'tensors "a" \(bytes \[0, 8\)\) and "b" \(bytes \[4, 8\)\) overlap'),
    ("hole", frame("{" + entry("a", "F32", "[1]", "[4, 8]") + "}", F2),
     r"bytes \[0, 4\) of the data region belong to no tensor \(a hole"),
    ("trailing bytes", frame("{" + entry("a", "F32", "[1]", "[0, 4]") + "}", F2), "4 bytes after the last tensor"),
    ("duplicate name", frame("{" + A + ", " + A + "}", F2), r'the key "a" twice \(a duplicated tensor name\)'),
    ("deep nesting", frame("[" * 100000 + "]" * 100000), "nests objects or arrays"),
    ("metadata not an object", frame('{"__metadata__": []}'), '"__metadata__" must be an object of strings'),
    ("metadata value not a string", frame('{"__metadata__": {"k": 1}}'), "values must be strings"),
]


@pytest.mark.parametrize("what,data,words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_files_raise_value_error(tmp_path, what, data, words):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=words) as info:
        st.load_file(path)
    message = str(info.value)
    assert "bad.safetensors" in message
    assert len(message) < 2000


def test_every_truncation_of_a_valid_file_is_rejected(tmp_path):
    good_path = tmp_path / "good.safetensors"
    write_independently(good_path, {"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int16)},
                        metadata={"k": "v"})
    good = good_path.read_bytes()
    for n in range(len(good)):
        path = tmp_path / "t.safetensors"
        path.write_bytes(good[:n])
        with pytest.raises(ValueError):
            st.load_file(path)


# ---------------------------------------------------------------------------
# Sharded checkpoints

def test_sharded_round_trip_in_the_hugging_face_layout(tmp_path):
    tensors = {
        "c": torch.randn(256),   # 1 KiB
        "b": torch.randn(1024),  # 4 KiB: alone in its shard
        "a": torch.randn(256),
        "d": torch.randn(256),
        "h": torch.randn(512).half(),
    }
    directory = tmp_path / "ckpt"
    index_path = st.save_sharded(tensors, directory, max_shard_size=2048, metadata={"step": "7"})
    assert index_path == str(directory / "model.safetensors.index.json")
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(os.listdir(directory)) == shards + ["model.safetensors.index.json"]

    index = json.loads(pathlib.Path(index_path).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["weight_map"] == {"a": shards[0], "b": shards[1], "c": shards[2], "d": shards[2], "h": shards[3]}
    # Every shard opens in the independent reader; together they hold everything.
    found = {}
    for shard in shards:
        got, metadata, _, _, _ = read_independently(directory / shard)
        assert metadata == {"format": "pt", "step": "7"}
        found.update(got)
    assert_same(found, tensors)

    for where in (directory, index_path):
        loaded = st.load_checkpoint(where)
        assert list(loaded) == sorted(tensors)
        assert_same(loaded, tensors)


def test_checkpoint_written_independently_loads(tmp_path):
    tensors = every_dtype()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[:5], names[5:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        write_independently(tmp_path / shard, {k: tensors[k] for k in part}, metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    assert_same(st.load_checkpoint(tmp_path), tensors)


def test_malformed_index_is_rejected(tmp_path):
    st.save_file({"w": torch.ones(2)}, tmp_path / "s.safetensors")
    index = tmp_path / "i.json"
    index.write_text('{"weight_map": {"w": "../s.safetensors"}}')
    with pytest.raises(ValueError, match="relative paths inside"):
        st.load_checkpoint(index)
    index.write_text('{"weight_map": {"v": "s.safetensors"}}')
    with pytest.raises(ValueError, match="lists tensor 'v' in shard 's.safetensors', which does not contain it"):
        st.load_checkpoint(index)
    index.write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        st.load_checkpoint(index)
    with pytest.raises(ValueError, match="must be > 0"):
        st.save_sharded({"w": torch.ones(1)}, tmp_path / "x", 0)
