"""`python -m jobs`: flags over config files, help, status, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from jobs.cli import build_parser, config_from_args, main
from tests.jobs.conftest import prompt_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def parse(argv):
    return config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_with_flags_overriding(tmp_path, suffix):
    values = {"dataset": "d.jsonl", "model": "m", "output": "o", "mode": "paths", "paths": 3,
              "max-tokens": 64, "stop": ["\n\n"]}
    path = tmp_path / f"job{suffix}"
    if suffix == ".yaml":
        import yaml

        path.write_text(yaml.safe_dump(values))
    else:
        path.write_text(json.dumps(values))
    cfg = parse(["generate", "--config", str(path), "--paths", "4", "--output", "other"])
    assert (cfg.mode, cfg.paths, cfg.max_tokens, cfg.output, cfg.stop) == ("paths", 4, 64, "other", ("\n\n",))


def test_unknown_config_key_and_missing_settings(tmp_path):
    from jobs.config import ConfigError

    path = tmp_path / "job.json"
    path.write_text(json.dumps({"dataset": "d", "model": "m", "output": "o", "temprature": 0.7}))
    with pytest.raises(ConfigError, match="unknown key 'temprature'"):
        parse(["generate", "--config", str(path)])
    with pytest.raises(ConfigError, match="missing required setting.*model"):
        parse(["generate", "--dataset", "d", "--output", "o"])


@pytest.mark.parametrize("values,message", [
    ({"overwrite": "false"}, "overwrite must be true or false, got 'false'"),
    ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
    ({"fast_paths": 5}, "fast_paths must be a mapping or a list of NAME=VALUE strings, got 5"),
    ({"max_tokens": "64"}, "max_tokens must be an integer, got '64'"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
])
def test_a_config_value_of_the_wrong_type_is_one_error_line_and_deletes_nothing(tmp_path, job_model, capsys,
                                                                                values, message):
    """A config file's "false" is a string, not a boolean: the job refuses
    it (exit 2, one ``error:`` line) before touching the folder, whose
    committed rows stay."""
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(2))
    out = tmp_path / "out"
    assert main(["generate", "--dataset", str(dataset), "--model", str(job_model), "--output", str(out),
                 "--max-tokens", "4"]) == 0
    capsys.readouterr()
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"dataset": str(dataset), "model": str(job_model), "output": str(out), **values}))
    assert main(["generate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"
    assert len(datasets.load_from_disk(str(out))) == 2


def test_ctrl_c_during_start_up_prints_the_resume_line_not_a_traceback(tmp_path, job_model, capsys, monkeypatch):
    """SIGINT while the model loads arrives as KeyboardInterrupt (the job's
    own handler is not installed yet): one line, the resume command, 130."""
    import jobs.distributed

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(jobs.distributed, "run_distributed_or_local", interrupted)
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(2))
    code = main(["generate", "--dataset", str(dataset), "--model", str(job_model), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert err.splitlines()[0] == "interrupted before decoding started; rows committed earlier are intact"
    assert err.splitlines()[1].startswith("resume with: ")


def test_help_imports_neither_mlx_lm_nor_datasets():
    """``--help`` answers at once: the commands import mlx-lm, transformers,
    pyarrow and datasets (seconds) only when they run."""
    probe = ("import sys\nfrom jobs.cli import main\ntry:\n    main(['generate', '--help'])\nexcept SystemExit:\n"
             "    pass\nprint(sorted(m for m in ('mlx_lm', 'datasets', 'pyarrow', 'transformers') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_help_documents_every_setting(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--dataset", "--model", "--output", "--mode", "--draft-tokens", "--paths", "--tau",
                 "--max-tokens", "--rows-per-shard", "--prompt-field", "--messages-field", "--id-field",
                 "--system-prompt", "--config", "--batch-size", "--overwrite"):
        assert flag in text
    parser = build_parser()
    generate = next(a for a in parser._subparsers._group_actions[0].choices["generate"]._actions
                    if a.dest == "mode").container  # the generate subparser's arguments
    for action in generate._group_actions:
        assert (action.help or "").count("(default") <= 1, action.option_strings  # one default, said once
    assert "default: None" not in text


def test_generate_then_status(tmp_path, job_model, capsys):
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(5) + [{"id": "bad", "prompt": ""}])
    out = tmp_path / "out"
    code = main(["generate", "--dataset", str(dataset), "--model", str(job_model), "--output", str(out),
                 "--max-tokens", "8", "--mode", "adaptive"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "done: 6/6 rows committed" in err and "1 errors" in err
    assert len(datasets.load_from_disk(str(out))) == 6
    assert main(["status", str(out)]) == 0
    status = capsys.readouterr().out
    assert "6/6 done (100.0%) (committed), 1 errors" in status and "last run:  finished at " in status
    assert "acceptance length: 1." in status or "acceptance length: 2." in status  # adaptive: drafts verified
    assert "tokens/s" in status


def test_prompts_and_completions_are_counted_apart(tmp_path, job_model, capsys):
    """--n 3 over 4 prompts: 12 completions of 4 prompts, never 12/4; a merge
    of two halves counts both and names both datasets."""
    halves = [write_jsonl(tmp_path / f"{h}.jsonl", rows) for h, rows in (("a", prompt_rows(4)[:2]),
                                                                          ("b", prompt_rows(4)[2:]))]
    for half in halves:
        code = main(["generate", "--dataset", str(half), "--model", str(job_model), "--output",
                     str(tmp_path / half.stem), "--max-tokens", "4", "--n", "3", "--temperature", "0.8"])
        err = capsys.readouterr().err
        assert code == 0 and "done: 6/6 completions of 2 prompts committed" in err, err
        assert "completions 6/6 (100.0%) of 2 prompts" in err  # the progress line
    assert main(["status", str(tmp_path / "a")]) == 0
    assert "rows:      6/6 completions done (100.0%) of 2 prompts" in capsys.readouterr().out
    merged = tmp_path / "merged"
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(merged)]) == 0
    capsys.readouterr()
    assert main(["status", str(merged)]) == 0
    status = capsys.readouterr().out
    assert "rows:      12/12 completions done (100.0%) of 4 prompts" in status
    assert f"dataset:   {halves[0]}, {halves[1]}" in status


def test_start_up_says_fast_paths_in_one_line_and_quiet_says_only_the_result(tmp_path, job_model, capsys):
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(3))
    base = ["generate", "--dataset", str(dataset), "--model", str(job_model), "--max-tokens", "4"]
    assert main(base + ["--output", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("job: ") and "| mode auto (0..3 drafts a step, chosen as it runs) | batch 32 |" in line
               for line in err)  # what it chose
    fast = [line for line in err if line.startswith("fast path")]
    assert len(fast) == 1 and fast[0].startswith("fast paths: ") and "(--verbose for each)" in fast[0]
    assert main(base + ["--output", str(tmp_path / "b"), "--verbose"]) == 0
    assert sum(line.startswith("fast path ") for line in capsys.readouterr().err.splitlines()) >= 10
    assert main(base + ["--output", str(tmp_path / "a"), "--quiet", "--max-tokens", "5", "--overwrite"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == ["done", "output"], err
    assert main(base + ["--output", str(tmp_path / "a"), "--max-tokens", "5", "--verbose"]) == 0  # resumes: speed only
    assert "done: 3/3 rows committed (0 this run" in capsys.readouterr().err
    assert main(base + ["--output", str(tmp_path / "c"), "--quiet", "--verbose"]) == 2
    assert "quiet and verbose exclude each other" in capsys.readouterr().err


def test_a_run_of_mostly_error_rows_exits_1_with_its_rows_committed(tmp_path, job_model, capsys):
    rows = prompt_rows(2) + [{"id": f"empty-{i}", "prompt": ""} for i in range(3)]
    dataset = write_jsonl(tmp_path / "in.jsonl", rows)
    base = ["generate", "--dataset", str(dataset), "--model", str(job_model), "--max-tokens", "4"]
    assert main(base + ["--output", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("error: 3 of the 5 rows this run committed are error rows (60.0%, above --max-error-rate "
                       "0.5); their `error` column says why")
    assert len(datasets.load_from_disk(str(tmp_path / "a"))) == 5
    assert main(base + ["--output", str(tmp_path / "b"), "--max-error-rate", "0.6"]) == 0
    assert main(base + ["--output", str(tmp_path / "c"), "--max-error-rate", "1.5"]) == 2


def test_status_speed_counts_ranks_working_together_once():
    from jobs.ledger import LedgerEntry, Totals

    def entry(writer, start, seconds, tokens):
        return LedgerEntry(shard=f"{writer}-{start}", writer=writer, ids=[], rows=1, errors=0,
                           completion_tokens=tokens, decode_s=seconds, wall_s=seconds, steps=0, accepted=0,
                           committed_at=start + seconds)

    t = Totals()
    # Two ranks side by side for 10 s, then (a resume) one rank alone for 5 s.
    for e in (entry("r000", 0, 10, 100), entry("r001", 0, 10, 100), entry("r000", 20, 5, 50)):
        t.add(e)
    assert t.elapsed_s == pytest.approx(15)
    assert t.tokens_per_s == pytest.approx(250 / 15)


def test_job_that_cannot_run_exits_nonzero_with_the_reason(tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(1))
    code = main(["generate", "--dataset", str(dataset), "--model", str(tmp_path / "nomodel"), "--output", str(tmp_path / "o")])
    assert code == 1
    assert "nomodel" in capsys.readouterr().err
    code = main(["generate", "--dataset", str(dataset), "--model", "m", "--output", "o", "--draft-tokens", "0"])
    assert code == 2
    assert "draft_tokens must be an int in 1..16, got 0" in capsys.readouterr().err


def test_status_of_a_non_job_folder(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 1
    assert "not a job output folder" in capsys.readouterr().err


def test_a_hub_id_is_read_from_the_local_hub_cache(tmp_path, job_model):
    """--model org/name resolves through the Hub cache's layout (refs/main ->
    snapshots/<revision>), as huggingface-cli download leaves it
    (huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE); the manifest
    records the revision. A missing one is one error line."""
    import shutil

    cache = tmp_path / "hub"
    snapshot = cache / "models--test-org--tiny-mtp" / "snapshots" / "0123abcd"
    shutil.copytree(job_model, snapshot)
    (cache / "models--test-org--tiny-mtp" / "refs").mkdir()
    (cache / "models--test-org--tiny-mtp" / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    dataset = write_jsonl(tmp_path / "in.jsonl", prompt_rows(2))
    out = tmp_path / "out"
    job = [sys.executable, "-m", "jobs", "generate", "--dataset", str(dataset), "--max-tokens", "4"]
    done = subprocess.run(job + ["--model", "test-org/tiny-mtp", "--output", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    model = json.loads((out / "manifest.json").read_text())["model"]
    assert model["revision"] == "0123abcd" and model["path"] == str(snapshot.resolve())
    absent = subprocess.run(job + ["--model", "test-org/absent", "--output", str(tmp_path / "o2")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    err = absent.stderr.strip().splitlines()
    assert absent.returncode == 1 and len(err) == 1, absent.stderr
    assert err[0].startswith("error: model 'test-org/absent' is not a local folder nor in the local Hugging Face Hub")
