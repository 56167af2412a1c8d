"""torchtitan's ``attn_mask_type="block_causal"`` flavors: ``model.attention_mask=block_causal`` with the
EOS id of the tokenizer ``hf_assets_path`` names, or a model change naming ``model.eos_token_id``."""

from __future__ import annotations

from jaxpar.cli import main
from jaxpar.port.torchtitan import port_torchtitan


def _toml(tmp_path, flavor: str, assets: str | None) -> str:
    path = tmp_path / "job.toml"
    line = "" if assets is None else f'hf_assets_path = "{assets}"\n'
    path.write_text(
        f'[model]\nname = "llama3"\nflavor = "{flavor}"\n{line}'
        "[training]\nlocal_batch_size = 1\nseq_len = 1024\nsteps = 10\n"
        "[parallelism]\ndata_parallel_shard_degree = -1\n"
    )
    return str(path)


def test_a_known_tokenizer_gives_the_separator(tmp_path):
    cfg, report = port_torchtitan(_toml(tmp_path, "8B_flex", "./assets/hf/Llama-3.1-8B/"), world_size=8)
    assert (cfg.model.attention_mask, cfg.model.eos_token_id) == ("block_causal", 128001)
    assert report.model_changes == [] and report.find("(document separator)").status == "mapped"


def test_an_unknown_tokenizer_is_a_model_change_naming_the_field(tmp_path, capsys):
    job = _toml(tmp_path, "8B_varlen", "./assets/hf/my-tokenizer")
    assert main(["port", "torchtitan", job, "--world-size", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: port torchtitan: (document separator) = ./assets/hf/my-tokenizer: flavor 8B_varlen")
    assert "--set model.eos_token_id=" in err and "\n" not in err
    cfg, report = port_torchtitan(job, world_size=8)  # as --approximate: causal attention, the change listed
    assert cfg.model.attention_mask == "causal"
    assert [e.source for e in report.model_changes] == ["(document separator)"]
