"""Run the field's clients, unmodified, against a local `dgemma serve` (loopback only), each in its own venv.

    python -m bench.clients [--install] [--venvs /tmp/clients] [--requests 4] [--port 8123]

`--install` creates one venv per client under --venvs (`pip install` from the configured registry; never into the
project's environment). The server is `dgemma serve --eager` on the demo model (HTTP behaviour; no compile). Inputs
are local: the demo's tokenizer directory, a JSONL of demo prompts, an lm-eval task over it. Each client runs with a
bounded request count and a timeout; the results (exit status, the client's own summary lines) go to
bench/results/clients_cpu_<date>.md. A client whose venv is missing is reported "not installed".

Client settings, each the client's own flag (never a patch to it):
- vLLM's bench (0.33) forces `ignore_eos: true` into every request of its random datasets on the OpenAI-compatible
  backends (serve.py: "when using random datasets, default to ignoring EOS"); the server implements it
  (`GenerationConfig.ignore_eos`: the answer runs to max_tokens), so those runs use the client's defaults.
- aiperf (0.13) runs without HF_HUB_OFFLINE: in offline mode its tokenizer loader calls
  `snapshot_download(<the --tokenizer path>, local_files_only=True)`, which rejects a local directory as a repo id;
  online, a local path loads directly (nothing is fetched: loopback only).
- guidellm (0.8) takes `kind=...,key=value` configs for --backend, --profile, --data, --tokenizer, --constraint and
  --output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dgemma_compile.demo import DEMO_MODEL

from .server import running_server

HOST = "127.0.0.1"
MODEL = "dgemma-demo"
PACKAGES = {"openai": ["openai"], "vllm": ["vllm[bench]"], "lmeval": ["lm-eval[api]", "transformers"], "guidellm": ["guidellm"],
            "aiperf": ["aiperf"]}
PROMPTS = ["sort 3 1 2 9 5=", "rev 1 2 3 4 5 6 7 8 9 0 1=", "add 123+045=", "dedup 3 1 3 2=", "sort 9 8 7=",
           "rev 4 4 1=", "add 5+7=", "sort 2 1="]
ANSWERS = ["1 2 3 5 9", "1 0 9 8 7 6 5 4 3 2 1", "0168", "3 1 2", "7 8 9", "1 4 4", "12", "1 2"]

OPENAI_SCRIPT = """
import openai, sys
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none", max_retries=0)
n = int(sys.argv[2])
ok = 0
for i in range(n):
    out = c.completions.create(model="dgemma-demo", prompt="sort 3 1 2 9 5=", seed=i)
    ok += out.choices[0].finish_reason in ("stop", "length")
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="dgemma-demo", messages=[{"role": "user", "content": "rev 1 2 3 4 5 6 7 8 9 0 1="}], seed=i,
        stream=True, stream_options={"include_usage": True}) if ch.choices)
    ok += bool(text)
print(f"openai {openai.__version__}: {ok}/{2 * n} requests answered")
sys.exit(0 if ok == 2 * n else 1)
"""


def _inputs(tmp: Path) -> dict[str, Path]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "text": p, "answer": a}) + "\n"
                               for p, a in zip(PROMPTS, ANSWERS)))
    task = tmp / "tasks"
    task.mkdir(exist_ok=True)
    (task / "dgemma_demo.yaml").write_text(
        "task: dgemma_demo\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(prompts) +
        "\ntest_split: test\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 16\nmetric_list:\n  - metric: exact_match\n")
    return {"prompts": prompts, "tasks": task}


def _runs(url: str, venvs: Path, inp: dict[str, Path], n: int) -> list[tuple[str, str, list[str], tuple[str, ...]]]:
    """(name, venv, argv, environment variables to unset) of every client run."""
    tok = str(DEMO_MODEL)
    bench = [f"{venvs}/vllm/bin/vllm", "bench", "serve", "--base-url", url, "--model", MODEL, "--tokenizer", tok,
             "--num-prompts", str(n), "--max-concurrency", "2"]
    random = ["--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "16"]
    lm = [f"{venvs}/lmeval/bin/lm_eval", "--tasks", "dgemma_demo", "--include_path", str(inp["tasks"]),
          "--limit", str(n)]
    aiperf = [f"{venvs}/aiperf/bin/aiperf", "profile", "--model", MODEL, "--url", url, "--streaming", "--tokenizer",
              tok, "--input-file", str(inp["prompts"]), "--custom-dataset-type", "single_turn", "--request-count",
              str(n), "--concurrency", "1", "--ui-type", "none"]
    guidellm = [f"{venvs}/guidellm/bin/guidellm", "run", "--profile", "kind=synchronous",
                "--data", f"kind=json_file,path={inp['prompts']}", "--tokenizer", f"kind=huggingface_auto,model={tok}",
                "--constraint", f"kind=max_requests,count={n}", "--disable-console-interactive"]
    out = inp["prompts"].parent
    return [
        ("openai client", "openai", [f"{venvs}/openai/bin/python", "-c", OPENAI_SCRIPT, url, str(n)], ()),
        ("vllm bench serve --backend openai (random)", "vllm",
         bench + ["--backend", "openai", "--endpoint", "/v1/completions", *random], ()),
        ("vllm bench serve --backend openai-chat (random)", "vllm",
         bench + ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", *random], ()),
        ("vllm bench serve --backend openai (custom)", "vllm",
         bench + ["--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "custom",
                  "--dataset-path", str(inp["prompts"]), "--custom-output-len", "16"], ()),
        ("vllm bench serve --backend openai-chat (custom)", "vllm",
         bench + ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "custom",
                  "--dataset-path", str(inp["prompts"]), "--custom-output-len", "16"], ()),
        ("vllm bench serve --ignore-eos", "vllm",
         bench + ["--backend", "openai", "--endpoint", "/v1/completions", *random, "--ignore-eos"], ()),
        ("lm-eval local-completions (local tokenizer)", "lmeval",
         lm + ["--model", "local-completions", "--model_args",
               f"model={MODEL},base_url={url}/v1/completions,tokenizer={tok},num_concurrent=1,max_retries=1"], ()),
        ("lm-eval local-completions (no tokenizer)", "lmeval",
         lm + ["--model", "local-completions", "--model_args",
               f"model={MODEL},base_url={url}/v1/completions,tokenized_requests=False,tokenizer_backend=None,"
               "num_concurrent=1,max_retries=1"], ()),
        ("lm-eval local-chat-completions", "lmeval",
         lm + ["--model", "local-chat-completions", "--apply_chat_template", "--model_args",
               f"model={MODEL},base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1"], ()),
        ("aiperf profile (chat, streaming, text prompts)", "aiperf",
         aiperf + ["--endpoint-type", "chat", "--artifact-dir", str(out / "aiperf_chat")], ("HF_HUB_OFFLINE",)),
        ("aiperf profile (completions, streaming, text prompts)", "aiperf",
         aiperf + ["--endpoint-type", "completions", "--artifact-dir", str(out / "aiperf_completions")],
         ("HF_HUB_OFFLINE",)),
        ("guidellm run (chat completions, text prompts)", "guidellm",
         guidellm + ["--backend", f"kind=openai_http,target={url},model={MODEL}",
                     "--output", f"kind=json,path={out / 'guidellm_chat.json'}"], ()),
        ("guidellm run (text completions, text prompts)", "guidellm",
         guidellm + ["--backend", f"kind=openai_http,target={url},model={MODEL},request_format=/v1/completions",
                     "--output", f"kind=json,path={out / 'guidellm_completions.json'}"], ()),
    ]


def _tail(text: str, lines: int = 12) -> list[str]:
    keep = [x for x in text.splitlines() if x.strip() and "Warning" not in x and "WARNING" not in x]
    summary = [x for x in keep if x.startswith(("Successful requests", "Failed requests", "Error ", "|"))  # vllm,
               or any(k in x for k in ("Request Count", "Request Error Rate", "Sequence Length"))]  # lm-eval, aiperf
    return summary + [x for x in keep[-lines:] if x not in summary]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venvs", type=Path, default=Path("/tmp/clients"))
    p.add_argument("--install", action="store_true", help="create the clients' venvs first")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--timeout", type=float, default=300, help="seconds per client run")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.install:
        for name, pkgs in PACKAGES.items():
            subprocess.run([sys.executable, "-m", "venv", str(args.venvs / name)], check=True)
            subprocess.run([str(args.venvs / name / "bin" / "pip"), "install", "-q", *pkgs], check=False)
    rows = []
    with running_server(["--eager", "--max-batch", "4"], port=args.port, timeout_s=120) as server, \
            tempfile.TemporaryDirectory() as d:
        url = server.url
        inp = _inputs(Path(d))
        env = {**os.environ, "OPENAI_API_KEY": "none", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "NO_PROXY": HOST}
        for name, venv, cmd, unset in _runs(url, args.venvs, inp, args.requests):
            if not (args.venvs / venv).exists():
                rows.append((name, "not installed", 0.0, []))
                continue
            t0 = time.perf_counter()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=d,
                                   env={k: v for k, v in env.items() if k not in unset})
                status, out = f"exit {r.returncode}", r.stdout + r.stderr
            except subprocess.TimeoutExpired as e:
                status, out = "timed out", (e.stdout or b"").decode(errors="replace")
            rows.append((name, status, time.perf_counter() - t0, _tail(out)))
            print(f"{name}: {status}", file=sys.stderr, flush=True)
    date = datetime.date.today().isoformat()
    out = args.out or Path(__file__).parent / "results" / f"clients_cpu_{date}.md"
    lines = [f"# Clients against `dgemma serve --eager` (demo model), {date}", "",
             f"Each client unmodified, in its own venv ({args.venvs}), {args.requests} requests, against {url}.", "",
             "| client | result | s |", "|---|---|---|"]
    lines += [f"| {n} | {s} | {t:.1f} |" for n, s, t, _ in rows]
    for n, s, _, tail in rows:
        lines += ["", f"## {n}: {s}", "", "```", *tail, "```"]
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
