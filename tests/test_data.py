"""Data: tokenizers, sources and their train/val split, errors, grain packing, shuffling, sharding,
iterator state, prepare -> ArrayRecord, and the packing guarantee that attention never crosses
documents (packed logits == each document run alone)."""

import json
import os

import numpy as np
import pytest

from farskip_jax.config import DataConfig
from farskip_jax.data.pipeline import make_iterator
from farskip_jax.data.prepare import main as prepare_main
from farskip_jax.data.sources import build_source, split_of, stdlib_files
from farskip_jax.data.tokenizer import ByteTokenizer, load_tokenizer
from farskip_jax.errors import DataError

DOCS = [f"document number {i}\n" + "x = %d\n" % i * (1 + (7 * i) % 13) for i in range(40)]


@pytest.fixture()
def text_dir(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i, t in enumerate(DOCS):
        (d / f"doc{i:03d}.txt").write_text(t)
    return d


def test_byte_tokenizer_ids():
    tok = ByteTokenizer()
    ids = tok.encode_document("aé")
    assert ids.tolist() == [256, 97, 0xC3, 0xA9, 257]
    assert tok.vocab_size == 259 and tok.pad_id == 258
    assert tok.decode(ids) == "aé"


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    t.save(str(path))
    tok = load_tokenizer(str(tmp_path))  # a folder holding tokenizer.json works too
    assert tok.encode_document("hello world foo").tolist() == [0, 3, 4, 2, 1]
    assert tok.vocab_size == 5 and tok.eos_id == 1
    with pytest.raises(DataError, match="tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_stdlib_split_is_by_file_and_deterministic():
    files = stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for _, f in files)
    cfg = DataConfig(source="stdlib")
    tr, va = build_source(cfg, "train", ByteTokenizer()), build_source(cfg, "val", ByteTokenizer())
    assert set(tr.files).isdisjoint(va.files) and len(tr.files) + len(va.files) == len(files)
    assert 0.005 < len(va.files) / len(files) < 0.05
    assert build_source(cfg, "val", ByteTokenizer()).files == va.files
    assert split_of("a/b.py", 0.5) == split_of("a/b.py", 0.5)


def test_text_and_jsonl_sources(text_dir, tmp_path):
    tok = ByteTokenizer()
    cfg = DataConfig(source="text", paths=(str(text_dir / "*.txt"),), val_fraction=0.2)
    tr, va = build_source(cfg, "train", tok), build_source(cfg, "val", tok)
    assert len(tr) + len(va) == len(DOCS) and len(va) > 0
    got = sorted(tok.decode(tr[i]) for i in range(len(tr))) + sorted(tok.decode(va[i]) for i in range(len(va)))
    assert sorted(got) == sorted(DOCS)
    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(DOCS)))
    jcfg = DataConfig(source="jsonl", paths=(str(jl),), text_field="body", val_fraction=0.2)
    jt, jv = build_source(jcfg, "train", tok), build_source(jcfg, "val", tok)
    assert sorted([tok.decode(jt[i]) for i in range(len(jt))] + [tok.decode(jv[i]) for i in range(len(jv))]) == sorted(DOCS)
    with pytest.raises(DataError, match="no field 'text'"):
        build_source(DataConfig(source="jsonl", paths=(str(jl),)), "train", tok)[0]


def test_clear_errors_on_empty_or_missing_input(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(DataError, match="does not exist"):
        build_source(DataConfig(source="text", paths=(str(tmp_path / "nope.txt"),)), "train", tok)
    with pytest.raises(DataError, match="matched no files"):
        build_source(DataConfig(source="text", paths=(str(tmp_path / "*.txt"),)), "train", tok)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no documents"):
        build_source(DataConfig(source="jsonl", paths=(str(empty),)), "train", tok)
    bad = tmp_path / "bad.txt"
    bad.write_text("hello")
    src = build_source(DataConfig(source="text", paths=(str(bad),), val_fraction=0.01), "train", tok)
    os.chmod(bad, 0)
    if os.access(bad, os.R_OK):  # root ignores permissions: make it unreadable another way
        os.remove(bad)
    with pytest.raises(DataError, match="cannot read"):
        src[0]


def _rows(cfg, n, **kw):
    it = make_iterator(cfg, "train", **kw)
    return [next(it) for _ in range(n)]


def test_packing_rows_targets_and_segments(text_dir):
    cfg = DataConfig(source="text", paths=(str(text_dir),), val_fraction=0.01, shuffle=False)
    b = _rows(cfg, 1, batch_size=4, seq_len=64, seed=0)[0]
    tok = ByteTokenizer()
    assert b["tokens"].shape == (4, 64) and b["loss_mask"].all()
    # targets are the next token of the same document; positions restart at each BOS
    for r in range(4):
        seg, pos, x, y = b["segment_ids"][r], b["positions"][r], b["tokens"][r], b["targets"][r]
        for j in range(63):
            if seg[j] == seg[j + 1]:
                assert y[j] == x[j + 1] and pos[j + 1] == pos[j] + 1
        starts = np.nonzero(x == tok.bos_id)[0]
        assert (pos[starts] == 0).all()
    assert b["segment_ids"].max() > 1  # several documents share a row


def test_shuffle_determinism_state_and_process_sharding(text_dir):
    cfg = DataConfig(source="text", paths=(str(text_dir),), val_fraction=0.01)
    kw = dict(batch_size=4, seq_len=32)
    a, b, c = _rows(cfg, 3, seed=1, **kw), _rows(cfg, 3, seed=1, **kw), _rows(cfg, 3, seed=2, **kw)
    assert all((x["tokens"] == y["tokens"]).all() for x, y in zip(a, b))
    assert any((x["tokens"] != y["tokens"]).any() for x, y in zip(a, c))
    # the iterator state survives a JSON round trip (it is stored in checkpoints as JSON)
    it = make_iterator(cfg, "train", seed=1, **kw)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    it2 = make_iterator(cfg, "train", seed=1, **kw)
    it2.set_state(state)
    assert all((w["tokens"] == g["tokens"]).all() and (w["positions"] == g["positions"]).all()
               for w, g in zip(want, [next(it2) for _ in range(3)]))
    # rows mode: process p gets rows [p*b, (p+1)*b) of the single-process global batch
    glob = _rows(cfg, 2, seed=1, **kw)
    parts = [_rows(cfg, 2, seed=1, process_index=p, process_count=2, **kw) for p in range(2)]
    for s in range(2):
        np.testing.assert_array_equal(np.concatenate([parts[0][s]["tokens"], parts[1][s]["tokens"]]), glob[s]["tokens"])
    # docs mode: processes read different documents
    dcfg = DataConfig(source="text", paths=(str(text_dir),), val_fraction=0.01, shard_by="docs")
    d0 = _rows(dcfg, 1, seed=1, process_index=0, process_count=2, **kw)[0]
    d1 = _rows(dcfg, 1, seed=1, process_index=1, process_count=2, **kw)[0]
    assert d0["tokens"].shape == (2, 32) and (d0["tokens"] != d1["tokens"]).any()


def test_prepare_arrayrecord_roundtrip(text_dir, tmp_path, capsys):
    out = tmp_path / "ar" / "corpus.array_record"
    assert prepare_main(["--source", "text", "--paths", str(text_dir), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "docs" in err and "tok/s" in err  # progress line
    meta = json.loads((tmp_path / "ar" / "corpus.array_record.meta.json").read_text())
    assert meta["documents"] == len(DOCS) and meta["tokenizer"] == "byte"
    tok = ByteTokenizer()
    cfg = DataConfig(source="arrayrecord", paths=(str(out),), val_fraction=0.1)
    tr, va = build_source(cfg, "train", tok), build_source(cfg, "val", tok)
    texts = sorted(tok.decode(s[i]) for s in (tr, va) for i in range(len(s)))
    assert texts == sorted(DOCS)
    b = next(make_iterator(cfg, "train", batch_size=2, seq_len=16, seed=0))
    assert b["tokens"].shape == (2, 16)
    # a different tokenizer than the one prepare used is refused
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"</s>": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="re-run prepare"):
        build_source(DataConfig(source="arrayrecord", paths=(str(out),), tokenizer=str(tmp_path / "tokenizer.json")),
                     "train", load_tokenizer(str(tmp_path / "tokenizer.json")))
    assert prepare_main(["--source", "text", "--paths", str(tmp_path / "none*.txt"), "--out", str(out)]) == 2


def test_packed_attention_never_crosses_documents(text_dir):
    """Logits of a packed row == logits of each document piece run alone (same positions)."""
    import jax.numpy as jnp
    from flax import nnx

    from farskip_jax.config import Config, ModelConfig, MoEConfig
    from farskip_jax.model.transformer import Transformer

    cfg = DataConfig(source="text", paths=(str(text_dir),), val_fraction=0.01, shuffle=False)
    b = _rows(cfg, 1, batch_size=2, seq_len=96, seed=0)[0]
    mcfg = Config(model=ModelConfig(vocab_size=259, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                    mlp_hidden=64, max_seq_len=512),
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32))
    model = Transformer(mcfg, rngs=nnx.Rngs(0))
    fwd = nnx.jit(lambda m, t, p, s: m(t, p, s).logits)
    fwd_noseg = nnx.jit(lambda m, t, p: m(t, p).logits)
    packed = np.asarray(fwd(model, jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]), jnp.asarray(b["segment_ids"])))
    # each document piece alone, left-aligned in its own row; the filler after it cannot reach it (causal)
    pieces, toks, poss = [], [], []
    for r in range(2):
        seg = b["segment_ids"][r]
        for s_id in np.unique(seg):
            idx = np.nonzero(seg == s_id)[0]
            t = np.full(96, 65, np.int32)
            p = np.arange(96, dtype=np.int32) + b["positions"][r, idx[0]]
            t[:len(idx)], p[:len(idx)] = b["tokens"][r, idx], b["positions"][r, idx]
            pieces.append((r, idx))
            toks.append(t)
            poss.append(p)
    alone = np.asarray(fwd_noseg(model, jnp.asarray(np.stack(toks)), jnp.asarray(np.stack(poss))))
    for k, (r, idx) in enumerate(pieces):
        np.testing.assert_allclose(packed[r, idx], alone[k, :len(idx)], rtol=1e-5, atol=1e-5)
    assert len(pieces) >= 3
    # and without segment ids the packed row would differ (the test can fail)
    mixed = np.asarray(fwd_noseg(model, jnp.asarray(b["tokens"]), jnp.asarray(b["positions"])))
    assert not np.allclose(mixed, packed, atol=1e-4)


def test_train_bpe_tokenizer(tmp_path):
    """A BPE fitted here (farskip_jax/studies/hard_corpus.py) is an ordinary HF tokenizer.json: BOS/EOS found, ids
    within the vocabulary, unseen and non-ASCII text round-trips, frequent words become single tokens."""
    from farskip_jax.data.tokenizer import train_bpe
    from farskip_jax.errors import ConfigError

    texts = ["To be, or not to be, that is the question:\n"] * 40 + ["Whether 'tis nobler in the mind to suffer\n"] * 40
    path = str(tmp_path / "bpe" / "tokenizer.json")
    tok = train_bpe(texts, 300, path)
    assert (tok.bos_id, tok.eos_id) == (0, 1) and 256 < tok.vocab_size <= 300
    assert load_tokenizer(path).vocab_size == tok.vocab_size
    unseen = "Ay, there's the rub: ñ, é, 東京\n"
    ids = tok.encode(unseen)
    assert ids.max() < tok.vocab_size and tok.decode(ids) == unseen
    assert len(tok.encode(" question")) <= 2 and len(tok.encode(texts[0])) < len(texts[0]) / 2.5
    doc = tok.encode_document("to be")
    assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
    with pytest.raises(ConfigError, match="vocab_size=100"):
        train_bpe(texts, 100, str(tmp_path / "small.json"))
