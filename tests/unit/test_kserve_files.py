"""What KServe's agent leaves in a model directory (daemon/kserve.py), and configs inferred from
exported programs (daemon/signature.py) as the repository scan uses them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from daemon import kserve
from daemon.repository import scan
from daemon.signature import UNBOUNDED_BATCH, inferred_config


@pytest.mark.parametrize(("text", "expected"), [
    ("1Gi", 2**30), ("512Mi", 512 * 2**20), ("1G", 10**9), ("1.5Gi", 3 * 2**29), ("100", 100), (4096, 4096),
    ("1e3", 1000), ("1500m", 2), ("0.5k", 500), ("+1Ki", 1024),
])
def test_quantities_read_as_kubernetes_reads_them(text: str | int, expected: int) -> None:
    assert kserve.parse_quantity(text) == expected


@pytest.mark.parametrize("bad", ["1GB", "one", "-1Gi", "", "1 Gi", True, 1.5])
def test_bad_quantities_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        kserve.parse_quantity(bad)  # type: ignore[arg-type]


def test_declared_memory_comes_from_the_newest_success_file(tmp_path: Path) -> None:
    assert kserve.declared_memory(tmp_path) is None
    old = tmp_path / "SUCCESS.aaa"
    old.write_text('{"storageUri": "s3://a", "framework": "pytorch", "memory": "1Gi"}')
    assert kserve.declared_memory(tmp_path) == 2**30
    new = tmp_path / "SUCCESS.bbb"
    new.write_text('{"storageUri": "s3://b", "framework": "pytorch", "memory": "2Gi"}')
    st = old.stat()
    import os
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert kserve.declared_memory(tmp_path) == 2**31
    new.write_text("{not json")
    with pytest.raises(kserve.AgentFileError, match=r"SUCCESS\.bbb is not JSON"):
        kserve.declared_memory(tmp_path)
    new.write_text('{"memory": "lots"}')
    with pytest.raises(kserve.AgentFileError, match="memory 'lots' is not a Kubernetes quantity"):
        kserve.declared_memory(tmp_path)


class TwoInTwoOut(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a.sum(dim=1, keepdim=True) + b.float(), a * 2


def export(path: Path, batch: torch.export.Dim | None, *, n: int = 2) -> Path:
    args = (torch.zeros(n, 5), torch.zeros(n, 1, dtype=torch.int64))
    dyn = ({0: batch}, {0: batch}) if batch is not None else None
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(torch.export.export(TwoInTwoOut(), args, dynamic_shapes=dyn), str(path))
    return path


def test_a_config_is_inferred_from_an_exported_program(tmp_path: Path) -> None:
    cfg = inferred_config(export(tmp_path / "m.pt2", torch.export.Dim("batch", min=1, max=16)))
    assert cfg["max_batch_size"] == 16
    assert cfg["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 5]},
                             {"name": "INPUT__1", "datatype": "INT64", "shape": [-1, 1]}]
    assert cfg["outputs"] == [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [-1, 1]},
                              {"name": "OUTPUT__1", "datatype": "FP32", "shape": [-1, 5]}]
    unbounded = inferred_config(export(tmp_path / "u.pt2", torch.export.Dim("batch")))
    assert unbounded["max_batch_size"] == UNBOUNDED_BATCH and "without an upper bound" in unbounded["description"]
    assert inferred_config(export(tmp_path / "one.pt2", None, n=1))["max_batch_size"] == 1


def test_the_scan_serves_bare_files_and_explains_what_it_cannot(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    export(repo / "bare" / "model.pt2", torch.export.Dim("batch", max=8))
    export(repo / "sidecar" / "model.pt2", torch.export.Dim("batch", max=8))
    (repo / "sidecar" / "config.toml").write_text(
        'max_batch_size = 4\nslo_ms = 50\n[[inputs]]\nname = "a"\ndatatype = "FP32"\nshape = [-1, 5]\n'
        '[[inputs]]\nname = "b"\ndatatype = "INT64"\nshape = [-1, 1]\n[[outputs]]\nname = "y"\n'
        'datatype = "FP32"\nshape = [-1, 1]\n[[outputs]]\nname = "z"\ndatatype = "FP32"\nshape = [-1, 5]\n')
    (repo / "sidecar" / "SUCCESS.abc").write_text('{"memory": "256Mi"}')
    export(repo / "fixed" / "model.pt2", None, n=3)
    export(repo / "both" / "1" / "model.pt2", torch.export.Dim("batch", max=8))
    export(repo / "both" / "model.pt2", torch.export.Dim("batch", max=8))
    result = scan(repo)
    specs = {m.name: m for m in result.models}
    assert set(specs) == {"bare", "sidecar"}
    bare, sidecar = specs["bare"], specs["sidecar"]
    assert (bare.version, bare.layout, bare.max_batch_size, bare.memory_bytes) == (1, "bare", 8, None)
    assert bare.config_file == repo / "bare" / "config.toml"
    assert (sidecar.max_batch_size, sidecar.slo_s, sidecar.memory_bytes) == (4, 0.05, 256 * 2**20)
    assert [t.name for t in sidecar.inputs] == ["a", "b"]
    assert "fixed batch of 3" in result.broken["fixed"]
    # Version directories and a bare file: the versions are meant, and the bare file has no config.
    assert "no config.toml" in result.broken["both"]
