"""An independent float reference: the checkpoint rebuilt with plain TorchRec, no project code."""
import json
from pathlib import Path

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.models.dlrm import DLRM, DLRM_DCN


def float_model(checkpoint: Path) -> torch.nn.Module:
    model = _build(json.loads((Path(checkpoint) / "model_config.json").read_text()))
    model.load_state_dict(torch.load(Path(checkpoint) / "weights.pt", weights_only=True))
    return model.eval()


def write_checkpoint(out: Path, config: dict, seed: int = 0) -> Path:
    """A checkpoint of ``config`` (model_config.json) with the model's own random initial weights."""
    torch.manual_seed(seed)
    out = Path(out)
    out.mkdir(parents=True)
    (out / "model_config.json").write_text(json.dumps(config))
    torch.save(_build(config).state_dict(), out / "weights.pt")
    return out


def _build(cfg: dict) -> torch.nn.Module:
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                           feature_names=t["feature_names"], pooling=PoolingType[t["pooling"]])
        for t in cfg["tables"]])
    kwargs = dict(embedding_bag_collection=ebc, dense_in_features=cfg["dense_in_features"],
                  dense_arch_layer_sizes=cfg["dense_arch_layer_sizes"], over_arch_layer_sizes=cfg["over_arch_layer_sizes"])
    return (DLRM_DCN(dcn_num_layers=cfg.get("dcn_num_layers", 3), dcn_low_rank_dim=cfg.get("dcn_low_rank_dim", 512), **kwargs)
            if cfg.get("model") == "dlrm_dcn" else DLRM(**kwargs))


def feature_names(checkpoint: Path):
    cfg = json.loads((Path(checkpoint) / "model_config.json").read_text())
    return [f for t in cfg["tables"] for f in t["feature_names"]]


def reference_outputs(checkpoint: Path, dense, values, lengths):
    """(ctr [B], pooled [B, sum(dims)] in feature order) of the float model."""
    model = float_model(checkpoint)
    names = feature_names(checkpoint)
    with torch.no_grad():
        kjt = KeyedJaggedTensor(keys=names, values=values, lengths=lengths)
        ctr = torch.sigmoid(model(dense, kjt)).reshape(-1)
        pooled = model.sparse_arch.embedding_bag_collection(kjt).to_dict()
        return ctr, torch.cat([pooled[n] for n in names], dim=1)


def errors(ctr, pooled, ref_ctr, ref_pooled):
    ctr_err = (ctr.float().cpu() - ref_ctr).abs().max().item()
    pooled_err = (torch.linalg.vector_norm(pooled.float().cpu() - ref_pooled) / torch.linalg.vector_norm(ref_pooled)).item()
    return ctr_err, pooled_err


def golden_request(version_dir: Path):
    """golden.pt of an artifact as a client sends it: (dense, (keys, lengths, values)) and the CTRs
    the artifact must answer (checked against the float model at export)."""
    from recserve.manifest import read_manifest

    golden = torch.load(Path(version_dir) / "golden.pt", weights_only=True)
    keys = [f.name for f in read_manifest(version_dir).features]
    return (golden["dense"].numpy(), (keys, golden["lengths"].numpy(), golden["values"].numpy())), golden["ctr"].numpy()
