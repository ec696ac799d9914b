"""Microbatch sources on a local C4-format dataset read through `datasets` (in process, fast):
stream slots equal TorchTitan's own loader, a spare's positions are served again, a checkpoint
state resumes exactly (also from an older state, by replay), exact mode packs map-style data."""

import pickle
from types import SimpleNamespace

import pytest
import torch

from c4_local import make_local_c4, stream_windows, tokenizer
from recover_hsdp.config import ConfigError, validate
from recover_hsdp.titan import model_spec
from recover_hsdp.titan.data import PackedSequences, open_stream_part, pack_dataset
from recover_hsdp.titan.sources import ExactSource, StreamSource
from recover_hsdp.workload import DataRef

SEQ, LBS = 32, 2


@pytest.fixture(scope="module")
def c4(tmp_path_factory, local_corpus):
    model_spec.register()
    return make_local_c4(tmp_path_factory.mktemp("c4"), docs_per_file=40)


def _job(path, dataset="c4", dump="/tmp", assignment="stream"):
    return SimpleNamespace(
        training=SimpleNamespace(dataset=dataset, dataset_path=str(path), seq_len=SEQ,
                                 local_batch_size=LBS),
        job=SimpleNamespace(dump_folder=str(dump)),
        model=SimpleNamespace(hf_assets_path=str(tokenizer().tokenizer_path)),
        recover=SimpleNamespace(workload=SimpleNamespace(data_assignment=assignment,
                                                          data_seed=0)))


def _source(c4, shard=0, ranks=1, slots=2):
    return StreamSource(open_stream_part(_job(c4), tokenizer()), fsdp_rank=shard,
                        fsdp_degree=ranks, slots=slots, local_batch_size=LBS)


def _crcs(batch):
    import zlib
    return [zlib.crc32(row.to(torch.int64).numpy().tobytes()) for row in batch[0]["input"]]


def test_a_slot_is_torchtitans_part_of_the_stream(c4):
    """Slot k, shard s reads data-parallel part k*S + s of W*S, as stock TorchTitan would."""
    source = _source(c4, shard=1, ranks=2, slots=2)        # slot 1, shard 1: part 3 of 4
    got = [c for p in range(3) for c in _crcs(source.microbatch(DataRef(1, p)))]
    assert got == stream_windows("c4", c4, 3, 4, SEQ, 3 * LBS)


def test_spare_positions_are_served_again_and_consumed_ones_never(c4):
    source = _source(c4)
    first = [_crcs(source.microbatch(DataRef(0, p))) for p in range(3)]   # a spare's compute
    assert _crcs(source.microbatch(DataRef(0, 0))) == first[0]            # next step: again
    source.consume(1, [DataRef(0, 0), DataRef(0, 1)])
    assert source.cursor == 2
    assert _crcs(source.microbatch(DataRef(0, 2))) == first[2]
    with pytest.raises(RuntimeError, match="consumed already"):
        source.microbatch(DataRef(0, 1))
    with pytest.raises(RuntimeError, match="not contiguous"):
        source.consume(2, [DataRef(0, 4)])


def test_checkpoint_state_resumes_at_the_cursor_and_older_states_replay(c4):
    source = _source(c4)
    for p in range(4):
        source.microbatch(DataRef(0, p))
    source.consume(1, [DataRef(0, p) for p in range(2)])  # cursor 2; 2, 3 read, not consumed
    state = source.checkpoint_state()
    assert state["slot"] == 0 and state["position"] == 2
    expected = [_crcs(source.microbatch(DataRef(0, p))) for p in (2, 3)]
    source.consume(2, [DataRef(0, 2), DataRef(0, 3)])
    later = [_crcs(source.microbatch(DataRef(0, p))) for p in (4, 5)]

    resumed = _source(c4)                                  # a restart: DCP round trip
    source.set_gathered([state])
    resumed.load_state_dict(pickle.loads(pickle.dumps(source.state_dict())))
    assert [_crcs(resumed.microbatch(DataRef(0, p))) for p in (2, 3)] == expected
    replayed = _source(c4)                                 # a slot resumed past its state
    replayed.load_state_dict(source.state_dict())
    assert _crcs(replayed.microbatch(DataRef(0, 4))) == later[0] and replayed.replayed == 2


def test_a_restart_may_read_another_slot_with_its_saved_state(c4):
    a, b = _source(c4), _source(c4)
    for p in range(2):
        b.microbatch(DataRef(1, p))
    b.consume(1, [DataRef(1, 0), DataRef(1, 1)])
    a.set_gathered([None, b.checkpoint_state()])
    nxt = _crcs(b.microbatch(DataRef(1, 2)))
    fresh = _source(c4)
    fresh.load_state_dict(a.state_dict())
    assert _crcs(fresh.microbatch(DataRef(1, 2))) == nxt


def test_exact_mode_packs_a_map_style_dataset(c4, tmp_path):
    job = _job(c4, dataset="c4_test", dump=tmp_path, assignment="exact")
    tokens = pack_dataset(job, tokenizer())
    assert pack_dataset(job, tokenizer()) == tokens       # cached
    import numpy as np
    seqs = PackedSequences(np.load(tokens), SEQ)
    source = ExactSource(seqs, fsdp_rank=1, fsdp_degree=2, local_batch_size=LBS)
    inputs = source.microbatch(DataRef(None, 3))[0]["input"]
    torch.testing.assert_close(inputs[0], seqs[(3 * 2 + 1) * LBS][0])
    with pytest.raises(ConfigError, match="loads as a stream"):
        pack_dataset(_job(c4, dataset="c4", dump=tmp_path / "x", assignment="exact"), tokenizer())


def _cfg(**training):
    from torchtitan.config import ConfigManager
    from conftest import DEBUG_CONFIG

    args = ["--job.config_file", str(DEBUG_CONFIG)]
    for key, value in training.items():
        args += [f"--{key}", str(value)]
    return ConfigManager().parse_args(args)


@pytest.mark.parametrize("fields,message", [
    ({"training.dataset": "c4", "training.dataset_path": "/tmp"},
     "recover.workload.data_assignment=exact needs a map-style dataset"),
    ({"training.dataset": "c4", "recover.workload.data_assignment": "stream", "training.dataset_path": ""},
     "training.dataset_path is empty"),
    ({"training.dataset": "c4_test", "training.dataset_path": "/nonexistent/c4"},
     "training.dataset_path='/nonexistent/c4' does not exist"),
])
def test_combinations_that_cannot_work_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(**fields))
