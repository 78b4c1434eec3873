"""Smoke tests: the examples run end to end with tiny sizes."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import helpers

# End-to-end runs of whole examples: the slow tier.
pytestmark = pytest.mark.slow


_load_example = helpers.load_example


def test_mnist_mlp_runs_and_returns_finite_losses(mnist, capsys):
  pytest.importorskip("flax")
  mnist_mlp = _load_example("mnist_mlp")
  results = mnist_mlp.main(["--max-steps", "3", "--hidden", "32",
                            "--batch-size", "32", "--epochs", "1",
                            "--log-every", "1", *mnist])
  assert set(results) == {"kfac", "adam"}
  for name, res in results.items():
    assert res["steps"] == 3, name
    assert len(res["epoch_losses"]) == 1, name
    assert all(math.isfinite(x) for x in res["epoch_losses"]), (name, res)
    assert 0.0 <= res["test_accuracy"] <= 1.0, name
  out = capsys.readouterr().out
  assert "final: K-FAC loss" in out
  assert "[kfac] epoch 1 step" in out


def _finite(xs):
  return all(math.isfinite(x) for x in xs)


def test_mnist_autoencoder_runs_and_writes_plot(mnist, tmp_path, capsys):
  pytest.importorskip("matplotlib")
  ae = _load_example("mnist_autoencoder")
  png = tmp_path / "ae.png"
  results = ae.main(["--steps", "4", "--scale", "0.01", "--batch-size",
                     "16", "--log-every", "2", "--window", "2", "--plot",
                     str(png), *mnist])
  k, a = results["kfac"], results["adam"]
  assert k["steps"] == 4
  for name, run in (("kfac", k), ("adam", a)):
    assert len(run["times"]) == run["steps"] >= 1, name
    assert _finite(run["losses"]) and math.isfinite(run["squared_error"])
  # Adam ran until it had used K-FAC's seconds (or hit its step cap).
  assert a["seconds"] >= k["seconds"] or a["steps"] == 400
  assert [r[0] for r in results["by_step"]][-1] == 4
  assert png.stat().st_size > 0
  out = capsys.readouterr().out
  assert "[kfac] step     2" in out and "kfac_optimizer final damping" in out


def test_paper_batch_schedule():
  ae = _load_example("mnist_autoencoder")
  sizes = [ae.paper_batch_size(k, 60000) for k in range(600)]
  assert sizes[0] == 1000 and sizes[499] == 32000 and sizes[500] == 60000
  assert sizes == sorted(sizes) and len(set(sizes)) == 7


def test_flax_cnn_classifier_runs(mnist, capsys):
  pytest.importorskip("flax")
  cnn = _load_example("flax_cnn_classifier")
  results = cnn.main(["--steps", "3", "--batch-size", "16", "--channels",
                      "4", "--hidden", "16", "--eval-examples", "64",
                      "--log-every", "1", *mnist])
  for name in ("kfac", "adam"):
    assert len(results[name]["losses"]) == 3, name
    assert _finite(results[name]["losses"]), name
    assert 0.0 <= results[name]["test_accuracy"] <= 1.0
  # Untagged: automatic registration found every layer, none generic.
  assert [kind for _, kind, _ in results["layers"]] == [
      "conv", "conv", "fully_connected", "fully_connected"]
  assert "found by" in capsys.readouterr().out  # describe() was printed.


def test_equinox_cnn_runs(mnist, tmp_path, capsys):
  pytest.importorskip("equinox")
  ex = _load_example("equinox_cnn")
  png = tmp_path / "eqx.png"
  results = ex.main(["--steps", "3", "--batch-size", "16", "--channels",
                     "2", "--code", "4", "--hidden", "8",
                     "--eval-examples", "64", "--window", "2",
                     "--log-every", "1", "--plot", str(png), *mnist])
  k, a = results["kfac"], results["adam"]
  for run in (k, a):
    assert len(run["losses"]) == len(run["times"]) == 3
    assert _finite(run["losses"]) and run["first_call_s"] > 0
  # Untagged: every Equinox layer recognised, none generic.
  assert [kind for _, kind, _ in results["layers"]] == [
      "conv", "conv", "fully_connected", "fully_connected",
      "fully_connected"]
  assert png.stat().st_size > 0
  assert "K-FAC reached it" in capsys.readouterr().out


def test_nnx_mlp_runs(mnist):
  pytest.importorskip("flax")
  nnx_mlp = _load_example("nnx_mlp")
  results = nnx_mlp.main(["--steps", "3", "--batch-size", "16", "--hidden",
                          "16", "--depth", "1", "--log-every", "0", *mnist])
  for name in ("kfac", "adam"):
    assert len(results[name]["losses"]) == 3, name
    assert _finite(results[name]["losses"]), name


@pytest.mark.parametrize("approx", ["kron_indep", "kron_series_2"])
def test_rnn_sequential_mnist_runs(approx, mnist):
  rnn = _load_example("rnn_sequential_mnist")
  results = rnn.main(["--steps", "3", "--batch-size", "16", "--hidden",
                      "8", "--eval-examples", "64", "--log-every", "0",
                      "--approx", approx, *mnist])
  # The input and recurrent layers are used once per row (28 times).
  assert results["layers"][:2] == [("['w_in'] + ['b_in']", approx, 28),
                                   ("['w_rec']", approx, 28)]
  for name in ("kfac", "adam"):
    assert len(results[name]["losses"]) == 3, name
    assert _finite(results[name]["losses"]), name


def test_char_gpt_races_kfac_and_adamw(tmp_path, capsys):
  pytest.importorskip("flax")
  pytest.importorskip("matplotlib")
  char_gpt = _load_example("char_gpt")
  data = tmp_path / "cycle.txt"  # Predictable: both must learn in 6 steps.
  data.write_text("abcdefgh" * 1000)
  png = tmp_path / "gpt.png"
  runs = char_gpt.main(["--data", str(data), "--steps", "6", "--eval-every",
                        "3", "--width", "16", "--heads", "2", "--layers", "1",
                        "--context", "8", "--batch-size", "4",
                        "--eval-batches", "1", "--sample-length", "7",
                        "--kfac-lr", "0.01", "--adam-lr", "0.01",
                        "--kfac-stats-fraction", "0.5", "--plot", str(png)])
  assert set(runs) == {"kfac", "adamw"}
  for name, run in runs.items():
    assert run.steps == 6 and len(run.step_seconds) == 6, name
    assert [s for s, _, _ in run.curve] == [0, 3, 6], name
    assert _finite([l for _, _, l in run.curve]), (name, run.curve)
    # Both learn the cycle: validation loss falls well below log(8).
    assert run.curve[-1][2] < 0.8 * run.curve[0][2], (name, run.curve)
  assert png.stat().st_size > 0
  out = capsys.readouterr().out
  assert "--- kfac sample ---" in out and "at 6 steps: K-FAC" in out


def test_char_gpt_dropout_is_per_sequence_and_off_without_seeds():
  pytest.importorskip("flax")
  from flax import nnx  # pylint: disable=import-outside-toplevel
  char_gpt = _load_example("char_gpt")
  args = char_gpt.parse_args(["--width", "16", "--heads", "2", "--layers",
                              "1", "--context", "8", "--batch-size", "4",
                              "--dropout", "0.5"])
  s = char_gpt.setup(args)
  batch = s["batch_fn"](0)
  assert batch["seed"].shape == (4,)
  x = s["new_model"]().tok(batch["x"])
  keys = jax.vmap(jax.random.PRNGKey)(batch["seed"])
  dropped = np.asarray(char_gpt.dropout(x, 0.5, keys, 0))
  # A sequence's mask depends on its own key only: the first two rows drop
  # the same entries whether or not the other rows come along.
  np.testing.assert_array_equal(char_gpt.dropout(x[:2], 0.5, keys[:2], 0),
                                dropped[:2])
  kept = dropped != 0
  assert 0.3 < kept.mean() < 0.7
  np.testing.assert_allclose(dropped[kept], 2 * np.asarray(x)[kept],
                             rtol=1e-6)
  # With seeds (training) the loss has dropout; without them (evaluation)
  # it is that of the same weights in a model built without dropout.
  plain = {k: v for k, v in batch.items() if k != "seed"}
  bare = char_gpt.GPT(65, args.context, args.width, args.layers, args.heads,
                      rngs=nnx.Rngs(0))
  bare_loss = char_gpt.make_loss_fn(nnx.split(bare, nnx.Param)[0])
  loss = s["loss_fn"]
  assert float(loss(s["params"], batch)) != float(loss(s["params"], plain))
  assert float(loss(s["params"], plain)) == pytest.approx(
      float(bare_loss(s["params"], plain)), rel=1e-6)


def test_nanogpt_race_smoke_prints_table_and_plot(tmp_path):
  """benchmarks/nanogpt_race.py --smoke, twice with one compilation cache:
  the table's numbers parse, the PNG exists, the second run's first calls
  come from the cache."""
  pytest.importorskip("flax")
  pytest.importorskip("matplotlib")
  root = helpers.ROOT
  png = tmp_path / "race.png"
  cmd = [sys.executable, str(root / "benchmarks" / "nanogpt_race.py"),
         "--smoke", "--plot", str(png), "--compilation-cache",
         str(tmp_path / "cache")]
  env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  for attempt, cache in (("cold", "miss"), ("warm", "hit")):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                         timeout=600, check=True).stdout
    assert "device: " in out and "jax " in out, out
    assert out.count("valid adamw") == 4, out  # a line every 10 steps
    rows = [l.split("|")[1:-1] for l in out.splitlines()
            if l.startswith(("| adamw", "| kfac_adamw"))]
    assert [r[0].strip() for r in rows] == ["adamw", "kfac_adamw"], out
    for r in rows:
      best, step, median, first = (float(r[1]), int(r[2]), float(r[6]),
                                   float(r[7]))
      assert math.isfinite(best) and 0 < best < math.log(65) + 0.5, r
      assert 0 <= step <= 40 and step % 10 == 0, r
      assert 0 < median / 1e3 < first, r  # ms against s
      assert r[8].strip().startswith(cache), (attempt, r)
    adam = rows[0]
    # AdamW reaches its own best at the step where it has it.
    assert int(adam[3]) == int(adam[2]) and float(adam[4]) > 0, adam
    assert png.stat().st_size > 0
    png.unlink()


def test_transformer_race_smoke_tables_and_plot(tmp_path):
  """benchmarks/transformer_race.py --smoke: a table per model with a row
  per optimizer family (PSGD Kron raced or said not to run), each run's
  validation losses and step times, and the PNG."""
  pytest.importorskip("flax")
  pytest.importorskip("equinox")
  pytest.importorskip("matplotlib")
  root = helpers.ROOT
  png, md = tmp_path / "race.png", tmp_path / "race.md"
  cmd = [sys.executable, str(root / "benchmarks" / "transformer_race.py"),
         "--smoke", "--plot", str(png), "--markdown", str(md)]
  env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       timeout=900, check=True).stdout
  text = md.read_text()
  assert text.count("AdamW's 10-step loss") == 2, text
  families = [l.split("|")[1].strip() for l in text.splitlines()
              if l.startswith("| ") and "steps to" not in l
              and not l.startswith("| run")]
  assert families.count("AdamW") == families.count("Muon") == 2, families
  assert families.count("kfac_adamw") == 2, families
  assert (families.count("PSGD Kron") == 2
          or sum("did not run" in l for l in text.splitlines()) == 2), text
  runs = [r for r in (l.split("|")[1:-1] for l in text.splitlines()
                      if l.startswith(("| adamw ", "| muon ", "| psgd ",
                                       "| kfac_adamw ")))
          if len(r[0].split()) == 2]  # "name rate": a run, not a family.
  assert len(runs) >= 6, text
  for r in runs:
    v10, v20, ms, first = (float(r[1]), float(r[2]), float(r[3]),
                           float(r[4].split()[0]))
    assert 0 < v20 < v10 < 2 * math.log(65), r  # All of them learn,
    if r[0].startswith(" adamw"):  # AdamW below the uniform guess.
      assert v20 < math.log(65), r
    assert 0 < ms / 1e3 < first, r
  # AdamW reaches its own losses at exactly 10 and 20 steps.
  assert "| AdamW | 10 (1.00×) |" in text, text
  assert "Fastest to AdamW's loss" in out and png.stat().st_size > 0


@pytest.mark.parametrize("optimizer", ["adamw", "kfac"])
def test_compile_depth_times_the_gpt_first_call(optimizer):
  """benchmarks/compile_depth.py's GPT child (what ``--gpt`` runs in a
  fresh process per depth): the first call of the char GPT's step at one
  block, as four positive stage times."""
  pytest.importorskip("flax")
  root = helpers.ROOT
  cmd = [sys.executable, str(root / "benchmarks" / "compile_depth.py"),
         "--gpt-child", "1", optimizer]
  env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       timeout=600, check=True).stdout
  times = json.loads(out.strip().splitlines()[-1])
  assert sorted(times) == ["compile", "lower", "run", "trace"], out
  assert all(t > 0 for t in times.values()), times
