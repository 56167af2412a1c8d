"""Copy the corpus files listed in corpus_files.tsv out of the local bare mirrors (fetch tool) and write SOURCES.md + manifest.json.

This is the script that built tests/fixtures/recipes/corpus (it refuses to overwrite an existing file)."""

import json
import os
import subprocess

ROOT = "/work/wt-corpus/tests/fixtures/recipes/corpus"


def gd(repo):
    return f"/work/.mirror/{repo.replace('/', '+')}/repo"


def git(repo, *a):
    return subprocess.run(["git", f"--git-dir={gd(repo)}", *a], check=True, capture_output=True).stdout


rows = []
for line in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_files.tsv")):
    fmt, name, repo, commit, path = line.rstrip("\n").split("\t")
    commit = git(repo, "rev-parse", commit + "^{commit}").decode().strip()
    mode = git(repo, "ls-tree", commit, "--", path).decode().split()[0]
    assert mode in ("100644", "100755"), (path, mode)
    data = git(repo, "show", f"{commit}:{path}")
    dest = os.path.join(ROOT, fmt, name)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    assert not os.path.exists(dest), dest
    with open(dest, "wb") as f:
        f.write(data)
    rows.append(
        dict(file=f"tests/fixtures/recipes/corpus/{fmt}/{name}", format=fmt, repo=repo, path=path, commit=commit)
    )
with open(os.path.join(ROOT, "manifest.json"), "w") as f:
    json.dump(rows, f, indent=2)
    f.write("\n")
with open(os.path.join(ROOT, "SOURCES.md"), "w") as f:
    f.write("# Recipe corpus sources\n\n")
    f.write(
        "Each file below is a verbatim copy (byte-for-byte, sha256-checked against `git show <commit>:<path>`)\n"
        "of a training recipe from a public GitHub repository at the recorded commit. Files are not edited.\n\n"
        "Notes:\n\n"
        "- torchtitan replaced its TOML train configs with a Python config registry in commit "
        '9810191bbb0385d8ac91cd31abbc7f4156a0d462 (2026-02-23, #2386); the "current" TOMLs here are taken from its parent '
        "238fa9953e4aec2a62582121564273d7cbb1e9f1, the last commit with `torchtitan/models/*/train_configs/*.toml`. "
        "The `2024_*` torchtitan files come from a99d2e5df7d6df0d99d8d5bd4db99ecb9f1014e6 (2024-08-30).\n"
        "- Megatron-LM `2024_*` files come from e70f83123f31cb432fcecb50848126bd245f3005, the parent of the commit that removed the top-level `examples/pretrain_*.sh` scripts (2024-06).\n"
        "- `megatron_deepspeed/` also holds the BigScience BLOOM tr11 SLURM launch scripts (BLOOM was trained with Megatron-DeepSpeed).\n"
        "- `manifest.json` lists the same rows in machine-readable form.\n\n"
    )
    f.write("| local path | repository | path in repository | commit | link |\n|---|---|---|---|---|\n")
    for r in rows:
        link = f"https://github.com/{r['repo']}/blob/{r['commit']}/{r['path']}"
        f.write(
            f"| `{r['file'][len('tests/fixtures/recipes/corpus/') :]}` | {r['repo']} | `{r['path']}` | `{r['commit']}` | [link]({link}) |\n"
        )
print(len(rows))
