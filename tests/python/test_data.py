"""roundpipe.data against files written by numpy and against an independent
implementation, written here, of the documented shuffled order
(splitmix64, rejection sampling, Fisher-Yates from the top down)."""
import numpy as np
import pytest
import torch

from roundpipe import data

# ---------------------------------------------------------------------------
# The independent implementation of the order

_M = (1 << 64) - 1


def _splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & _M
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return state, z ^ (z >> 31)


def independent_order(n, seed, epoch):
    _, first = _splitmix64(seed)
    state = first ^ ((epoch * 0xD1B54A32D192ED69) & _M)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        threshold = ((1 << 64) - bound) % bound
        while True:
            state, r = _splitmix64(state)
            if r >= threshold:
                break
        j = r % bound
        order[i], order[j] = order[j], order[i]
    return order


# ---------------------------------------------------------------------------
# Files


@pytest.mark.parametrize("np_dtype", [np.uint16, np.uint32])
def test_reads_numpy_files_identically(tmp_path, np_dtype):
    rng = np.random.default_rng(0)
    high = 65536 if np_dtype == np.uint16 else 2**32
    ids = rng.integers(0, high, size=5000, dtype=np.int64)
    ids[:2] = [0, high - 1]
    path = tmp_path / "train.bin"
    np.array(ids, dtype=np_dtype).tofile(path)

    f = data.TokenFile(path, dtype=np_dtype)
    assert len(f) == f.size() == 5000
    assert f.dtype == np.dtype(np_dtype).name
    t = f.tokens(0, 5000)
    assert t.dtype == torch.int64
    assert torch.equal(t, torch.from_numpy(ids))
    assert torch.equal(f.tokens(1234, 7), torch.from_numpy(ids[1234:1241]))
    assert np.array_equal(np.memmap(path, dtype=np_dtype, mode="r"), ids.astype(np_dtype))

    # write_token_file produces the bytes numpy does.
    out = tmp_path / "ours.bin"
    data.write_token_file(out, torch.from_numpy(ids), dtype=np_dtype)
    assert out.read_bytes() == path.read_bytes()


def test_default_dtype_is_uint16_like_nanogpt(tmp_path):
    path = tmp_path / "a.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    assert data.TokenFile(path).dtype == "uint16"
    assert len(data.TokenFile(str(path))) == 10
    assert data.TokenFile(path, vocab_size=100000).dtype == "uint32"


def test_malformed_files(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="not a multiple of 2"):
        data.TokenFile(odd)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        data.TokenFile(empty)
    with pytest.raises(RuntimeError, match="missing.bin"):
        data.TokenFile(tmp_path / "missing.bin")
    with pytest.raises(ValueError, match="unknown token dtype"):
        data.TokenFile(odd, dtype="int8")

    big = tmp_path / "big.bin"
    ids = np.zeros(40, dtype=np.uint16)
    ids[33] = 300
    ids.tofile(big)
    f = data.TokenFile(big, vocab_size=256)
    assert f.tokens(0, 10).tolist() == [0] * 10
    with pytest.raises(ValueError, match="position 33 is 300, not below vocab_size 256"):
        f.tokens(30, 5)
    with pytest.raises(ValueError, match="position 33"):
        f.validate()
    with pytest.raises(ValueError, match="does not fit uint16"):
        data.write_token_file(tmp_path / "w.bin", [1, 70000])


# ---------------------------------------------------------------------------
# Batches


def test_batches_shapes_and_shift(tmp_path):
    ids = (np.arange(4097, dtype=np.int64) * 7919) % 50257
    path = tmp_path / "train.bin"
    ids.astype(np.uint16).tofile(path)
    batcher = data.TokenBatcher(path, seq_len=32, seed=5)
    assert batcher.train_windows == 4096 // 32
    for _ in range(3):
        pos = batcher.position()
        x, y = batcher.next_batch(4)
        assert x.shape == y.shape == (4, 32)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for r in range(4):
            w = batcher.window_at(pos.seed, pos.epoch, pos.index + r)
            assert x[r].tolist() == ids[w * 32:w * 32 + 32].tolist()
            assert y[r].tolist() == ids[w * 32 + 1:w * 32 + 33].tolist()


def test_order_matches_the_documented_algorithm():
    for n, seed, epoch in [(8, 0, 0), (100, 1, 0), (100, 1, 1), (37, 2**64 - 1, 5)]:
        assert data.shuffled_order(n, seed, epoch) == independent_order(n, seed, epoch)
    assert data.shuffled_order(100, 1, 0) != data.shuffled_order(100, 2, 0)
    assert data.shuffled_order(100, 1, 0) != data.shuffled_order(100, 1, 1)


def test_every_window_once_per_epoch_and_resume():
    tokens = torch.arange(7 * 9 + 1)
    batcher = data.TokenBatcher(tokens, seq_len=9, seed=42)
    assert batcher.train_windows == 7
    firsts = []
    for _ in range(7):
        x, _ = batcher.next_batch(1)
        firsts.append(int(x[0, 0]))
    assert sorted(firsts) == [9 * w for w in range(7)]
    assert batcher.position() == data.DataPosition(42, 1, 0)

    state = batcher.state_dict()
    assert state == {"seed": 42, "epoch": 1, "index": 0}
    expected = [batcher.next_batch(3) for _ in range(5)]  # crosses epoch boundaries
    resumed = data.TokenBatcher(tokens, seq_len=9, seed=42)
    resumed.load_state_dict(state)
    for x, y in expected:
        rx, ry = resumed.next_batch(3)
        assert torch.equal(rx, x) and torch.equal(ry, y)
    assert resumed.position() == batcher.position()
    with pytest.raises(ValueError, match="index in \\[0, 7\\)"):
        resumed.seek((42, 0, 7))


def test_eval_split_is_disjoint():
    tokens = torch.arange(20 * 4 + 1)
    batcher = data.TokenBatcher(tokens, seq_len=4, eval_windows=5)
    train = set()
    for _ in range(batcher.train_windows):
        x, y = batcher.next_batch(1)
        train |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    held_out = set()
    batches = batcher.eval_batches(2)
    assert [b[0].shape[0] for b in batches] == [2, 2, 1]
    for x, y in batches:
        held_out |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert len(held_out) == 5 * 4 + 1
    assert not train & held_out


def test_bad_arguments():
    tokens = torch.arange(11)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        data.TokenBatcher(tokens, seq_len=0)
    with pytest.raises(ValueError, match="too few for one sequence of seq_len 11"):
        data.TokenBatcher(tokens, seq_len=11)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        data.TokenBatcher(tokens, seq_len=2).next_batch(0)
    with pytest.raises(ValueError, match="not both"):
        data.TokenBatcher(tokens, seq_len=2, eval_windows=1, eval_fraction=0.5)


# ---------------------------------------------------------------------------
# The built-in corpus


def test_default_corpus_and_byte_tokenizer():
    text = data.default_corpus()
    assert "Alice" in text and len(text) > 20000
    tokens = data.default_tokens()
    assert tokens.dtype == torch.int64 and tokens.numel() == len(text.encode("utf-8"))
    assert data.decode_bytes(tokens).decode("utf-8") == text
    f = data.default_token_file()
    assert f.vocab_size == data.BYTE_VOCAB_SIZE == 256
    assert torch.equal(f.tokens(0, len(f)), tokens)

    assert data.encode_bytes("caf\u00e9").tolist() == [99, 97, 102, 0xC3, 0xA9]
    assert data.encode_bytes(b"\x00\xff").tolist() == [0, 255]
    assert data.decode_bytes([72, 105]) == b"Hi"
    with pytest.raises(ValueError, match="position 1 is 256"):
        data.decode_bytes(torch.tensor([65, 256]))
