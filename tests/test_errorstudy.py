"""The error study (``python -m research vnmse``, research/errorstudy.py)
and the gradient capture (research/scripts/capture_gradients.py)."""
import argparse
import importlib.util
import json
import os

import numpy as np
import pytest

from research import errorstudy
from research.__main__ import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(**kw):
    p = argparse.ArgumentParser()
    errorstudy.add_arguments(p)
    args = p.parse_args([])
    args.quiet = True
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_cli_json_rows_and_values(tmp_path, capsys):
    out = tmp_path / "study.json"
    cli(["vnmse", "--data", "lognormal,gradient_like", "--ranks", "2,4", "--length", "8192",
         "--codecs", "exact,bf16,dynamiq:5,dynamiq:8.25,mxfp:e4m3", "--quiet", "--json", str(out)])
    text = capsys.readouterr().out
    assert "lognormal, ring" in text and "gradient_like, butterfly" in text
    assert "equal bits: mxfp:e4m3" in text
    res = json.loads(out.read_text())
    assert res["kind"] == "sweep" and res["ranks"] == [2, 4] and res["git"]
    rows = res["rows"]
    assert len(rows) == 2 * 5 * 2 * 2
    keys = {(r["data"], r["codec"], r["topology"], r["ranks"]) for r in rows}
    assert len(keys) == len(rows)
    for r in rows:
        assert "error" not in r, r
        assert r["length"] == 8192 and r["engine"] == "scale"
        assert 0 <= r["vnmse"] < 1 and np.isfinite(r["vnmse"])
        if r["codec"] == "exact":
            assert r["bits_per_coord"] == 32.0 and r["vnmse"] < 1e-12
        elif r["codec"] == "bf16":
            assert r["bits_per_coord"] == 16.0 and 1e-7 < r["vnmse"] < 1e-4
        elif r["codec"] == "dynamiq:5":
            assert 4.5 < r["bits_per_coord"] <= 5.0 and r["vnmse"] < 0.05
        elif r["codec"] == "mxfp:e4m3":
            assert r["bits_per_coord"] == 8.25
    assert res["datasets"]["gradient_like"]["zero_supergroup_fraction"]["zero_supergroups_n2"] > 0.1


def test_ablation_mode(tmp_path, capsys):
    res = errorstudy.run(_args(ablation=True, data="gradient_like", ranks="4", length=16384,
                               topologies="ring", json=str(tmp_path / "a.json")))
    assert "ablation" in capsys.readouterr().out
    rows = res["rows"]
    assert [r["codec"] for r in rows] == [name for name, _ in errorstudy.ablation_ladder(5.5)]
    assert all(r["bits_per_coord"] <= 5.5 + 1e-9 for r in rows)
    assert rows[-1]["vnmse"] < rows[0]["vnmse"] / 10
    assert json.loads((tmp_path / "a.json").read_text())["kind"] == "ablation"


def test_codec_list_and_parsing():
    from dynamiq_mpi import DynamiQ
    have = errorstudy.available_codecs(("exact", "dynamiq:5", "nosuchcodec", "mxfp:e9m9"))
    assert have == ["exact", "dynamiq:5"]
    assert set(errorstudy.available_codecs()) >= {"exact", "bf16", "dynamiq:5", "mxfp:e4m3"}
    assert errorstudy.parse_codec("dynamiq:5") == DynamiQ(bits=5, small_input=0)
    assert errorstudy.parse_codec("dynamiq:5:small_input=7").small_input == 7


def test_scale_code_and_bf16_class_options():
    """--scale-code / --bf16-class set the DynamiQ fields a spelling leaves
    out; the earlier defaults stay reachable both ways."""
    from dynamiq_mpi import DynamiQ
    old = DynamiQ(bits=5, small_input=0, scale_code="ceil", bf16_class=False)
    over = errorstudy.dynamiq_overrides(_args(scale_code="ceil", bf16_class="off"))
    assert over == {"scale_code": "ceil", "bf16_class": False}
    assert errorstudy.parse_codec("dynamiq:5", over) == old
    assert errorstudy.parse_codec("dynamiq:5:scale_code=ceil:bf16_class=false") == old
    # a spelling's own field wins over the command line
    assert errorstudy.parse_codec("dynamiq:5:bf16_class=true", over).bf16_class is True
    assert errorstudy.dynamiq_overrides(_args()) == {}
    assert errorstudy.parse_codec("dynamiq:5", {}) == DynamiQ(bits=5, small_input=0)
    assert errorstudy.parse_codec("mxfp:e4m3", over) == errorstudy.parse_codec("mxfp:e4m3")
    res = errorstudy.run(_args(data="lognormal", ranks="2", length=4096, codecs="dynamiq:5",
                               topologies="ring", bf16_class="off", scale_code="ceil"))
    assert res["codec_signatures"]["dynamiq:5"] == list(map(str, old.signature()))
    assert res["dynamiq_overrides"] == over


def test_ablation_ladder_ends_at_the_defaults():
    from dynamiq_mpi import DynamiQ
    ladder = errorstudy.ablation_ladder(5.5)
    assert ladder[4][1].scale_code == "ceil" and not ladder[4][1].bf16_class   # paper's Table 6
    assert ladder[-1][1] == DynamiQ(bits=5.5, small_input=0)


def test_simulate_engine_matches_scale_engine():
    data = errorstudy._Data("lognormal", _args(length=3000, seed=4), 4)
    codec = errorstudy.parse_codec("dynamiq:5")
    a = errorstudy.run_one(data, 4, codec, "butterfly", 4, 1, engine="auto")
    b = errorstudy.run_one(data, 4, codec, "butterfly", 4, 1, engine="simulate")
    assert a[4] == "scale" and b[4] == "simulate"
    assert a[0] == pytest.approx(b[0], rel=1e-9) and a[1] == pytest.approx(b[1], rel=1e-12)


def _fake_capture(folder, ranks=4, emb=1024, dense=700):
    rng = np.random.default_rng(0)
    g = rng.standard_normal((ranks, emb + dense)).astype(np.float32)
    g[:, 512:emb] = 0                      # embedding rows no rank saw
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / f"{errorstudy.REAL_NAME}.npy", g)
    meta = {"dense_start": emb, "length": emb + dense, "ranks": ranks, "tensors": [],
            "model": {}, "sha256": "x"}
    (folder / f"{errorstudy.REAL_NAME}.json").write_text(json.dumps(meta))
    return g


def test_real_data_sets_from_cache(tmp_path):
    g = _fake_capture(tmp_path)
    args = _args(cache=str(tmp_path))
    real = errorstudy._Data("real", args, 4)
    dense = errorstudy._Data("real-dense", args, 2)
    assert real.length == g.shape[1] and dense.length == 700
    assert np.array_equal(real.xs(4)[3], g[3]) and np.array_equal(dense.xs(2)[1], g[1, 1024:])
    zeros = real.notes["zero_supergroup_fraction"]
    assert zeros["zero_supergroups_n4"] == pytest.approx(2 / 7, abs=1e-4)
    with pytest.raises(SystemExit):
        errorstudy._Data("real", args, 8)            # more ranks than captured
    with pytest.raises(FileNotFoundError):
        errorstudy.real_gradients(tmp_path / "none", capture=False)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    errorstudy.run(_args(data="lognormal", ranks="2,4", length=2048, codecs="bf16,dynamiq:5",
                         plot=str(png)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def _capture_module():
    spec = importlib.util.spec_from_file_location(
        "capture_gradients", os.path.join(ROOT, "research", "scripts", "capture_gradients.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_capture_vocabulary():
    cap = _capture_module()
    toks = cap.tokenize(b"def f(x):\n    return x + 12 # x_y\n")
    assert toks == ["def", "f", "(", "x", ")", ":", "return", "x", "+", "12", "#", "x_y"]
    vocab = cap.build_vocab(toks, 4)
    assert vocab == {"<unk>": 0, "x": 1, "#": 2, "(": 3}


@pytest.mark.slow            # ~10 s of CPU, most of it importing transformers
def test_capture_tiny(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cap = _capture_module()
    meta = cap.main(["--out", str(tmp_path / "g"), "--ranks", "3", "--vocab", "300",
                     "--hidden", "16", "--layers", "1", "--heads", "2", "--intermediate", "32",
                     "--seq-len", "16", "--batch", "2", "--micro-batch", "1", "--steps", "2",
                     "--corpus-bytes", "200000"])
    g = np.load(tmp_path / "g.npy")
    assert g.shape == (3, meta["length"]) and meta["dense_start"] == 300 * 16
    emb = g[:, :meta["dense_start"]].reshape(3, 300, 16)
    zero_rows = (emb == 0).all(axis=2)
    # a micro-batch of 16 tokens touches at most 16 embedding rows, every other row is 0
    assert ((~zero_rows).sum(axis=1) <= 16).all() and (~zero_rows).any(axis=1).all()
    assert np.all(g[:, meta["dense_start"]:] != 0, axis=0).mean() > 0.5   # dense layers
    assert meta["tensors"][0]["name"].endswith("embed_tokens.weight")
    assert not any(t["name"].startswith("lm_head") for t in meta["tensors"])


def test_codecs_without_scale_adapter_run_on_simulate_allreduce():
    from research.scale_sim import supports
    others = [s for s in errorstudy.available_codecs(("thc", "omnireduce"))
              if not supports(errorstudy.parse_codec(s))]
    if not others:
        pytest.skip("no registered codec without a scale-simulator adapter")
    data = errorstudy._Data("gradient_like", _args(length=4096), 4)
    for spec in others:
        err, bits, _, _, engine = errorstudy.run_one(data, 4, errorstudy.parse_codec(spec),
                                                     "ring", 0, 0)
        assert engine == "simulate" and 0 < err < 1 and bits > 0


def test_paths_resolve_to_the_checkout():
    # the module lives in research/: the repository is one folder up
    assert errorstudy.CAPTURE_SCRIPT.exists()
    assert errorstudy.DEFAULT_CACHE == errorstudy.REPO / ".cache" / "gradients"


FLAT_ROW_KEYS = {"data", "codec", "topology", "ranks", "length", "bits_per_coord", "vnmse",
                 "vnmse_calls", "widths", "codec_info", "seconds", "engine"}


def test_node_size_rows(tmp_path, capsys):
    """--node-size K: the hierarchical call, one row per call with the flat
    keys plus node_size, nodes, rail_topology; a butterfly over a node count
    that is not a power of two runs the ring on the rail level (said in the
    row, never an error); ranks that do not make whole nodes: an error row."""
    from research.scale_levels import levels_allreduce
    out = tmp_path / "levels.json"
    cli(["vnmse", "--data", "lognormal", "--ranks", "4,5,6,8", "--length", "5000",
         "--codecs", "dynamiq:5,thc", "--node-size", "2", "--quiet", "--json", str(out)])
    text = capsys.readouterr().out
    assert "nodes of 2 (hierarchical, joint rail budget)" in text
    assert "lognormal, butterfly, nodes of 2" in text
    assert "n=6: the node count is not a power of two" in text
    res = json.loads(out.read_text())
    assert res["node_size"] == 2 and res["rail_budget"] == "joint"
    codecs = {c for c in errorstudy.available_codecs(("dynamiq:5", "thc"))}
    rows = res["rows"]
    assert len(rows) == 4 * 2 * 2
    for r in rows:
        assert r["node_size"] == 2 and r["rail_budget"] == "joint"
        if r["ranks"] == 5:
            assert "nodes of 2" in r["error"]
            continue
        if r["codec"] not in codecs:
            continue
        assert "error" not in r, r
        assert FLAT_ROW_KEYS <= set(r) and r["nodes"] == r["ranks"] // 2
        expect = "ring" if r["topology"] == "butterfly" and r["ranks"] == 6 else r["topology"]
        assert r["rail_topology"] == expect and ("rail_note" in r) == (expect != r["topology"])
        assert r["engine"] == "scale"      # every codec has a role-by-role adapter
        assert 0 < r["vnmse"] < 1 and r["bits_per_coord"] > 4
        assert len(r["codec_info"]["rails"]) == 2
    row = next(r for r in rows if (r["codec"], r["topology"], r["ranks"]) == ("dynamiq:5",
                                                                              "ring", 8))
    data = errorstudy._Data("lognormal", _args(length=5000), 8)
    direct = levels_allreduce(data.source, 8, 2, codec=errorstudy.parse_codec("dynamiq:5"))
    assert row["vnmse"] == direct.vnmse and row["bits_per_coord"] == direct.bits_per_coord
    # --rail-budget even: each rail planned apart
    spec = "dynamiq:5:small_input=0"        # (rails of 2500 elements: no BF16 fallback)
    cli(["vnmse", "--data", "lognormal", "--ranks", "8", "--length", "5000", "--codecs",
         spec, "--topologies", "ring", "--node-size", "2", "--rail-budget", "even",
         "--quiet", "--json", str(out)])
    even = json.loads(out.read_text())["rows"][0]
    codec = errorstudy.parse_codec(spec)
    apart = levels_allreduce(data.source, 8, 2, codec=codec, rail_budget="even")
    assert even["rail_budget"] == "even" and even["vnmse"] == apart.vnmse
    assert even["bits_per_coord"] == apart.bits_per_coord


def test_node_size_one_is_the_flat_study(capsys):
    kw = dict(data="lognormal", ranks="2,4", length=3000, codecs="dynamiq:5,bf16")
    flat = errorstudy.run(_args(**kw))
    text_flat = capsys.readouterr().out
    one = errorstudy.run(_args(node_size=1, **kw))
    text_one = capsys.readouterr().out
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip(one["rows"]) == strip(flat["rows"])
    assert all(set(r) == FLAT_ROW_KEYS for r in flat["rows"])
    cut = lambda t: t[:t.rindex("\n(")]          # less the wall-clock line
    assert cut(text_one) == cut(text_flat) and "nodes of" not in text_flat
