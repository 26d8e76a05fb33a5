"""CUDA IPC tensors pickled the way SGLang's patched torch reductions send them
(sglang/srt/utils/patch_torch.py: the device index replaced by the device's UUID, rebuilt by
`_rebuild_cuda_tensor_modified`), from a process of its own, loaded through the server's
allow-list unpickler. GPU only."""
import base64
import multiprocessing as mproc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _sender(conn):
    import io
    import sys
    import types

    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions

    name = "sglang.srt.utils.patch_torch"
    for i in range(1, 5):
        sys.modules.setdefault(".".join(name.split(".")[:i]), types.ModuleType(".".join(name.split(".")[:i])))

    def _rebuild_cuda_tensor_modified(*args):
        raise AssertionError("only the receiver rebuilds")

    _rebuild_cuda_tensor_modified.__module__ = name
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"
    sys.modules[name]._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified

    def reduce_with_uuid(t):
        fn, args = reductions.reduce_tensor(t)
        if fn is reductions.rebuild_cuda_tensor:
            args = list(args)
            args[6] = str(torch.cuda.get_device_properties(args[6]).uuid)
            return _rebuild_cuda_tensor_modified, tuple(args)
        return fn, args

    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4) * 0.5
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = {**ForkingPickler._extra_reducers, torch.Tensor: reduce_with_uuid}
    pickler.dump([("w", t)])
    conn.send(base64.b64encode(buf.getvalue()).decode())
    conn.recv()   # NOTE: the sender keeps the tensor alive until the receiver has copied it


def test_cuda_ipc_push_with_device_uuid():
    from rollout.server.pickled_tensors import load_serialized_named_tensors

    ctx = mproc.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child,))
    proc.start()
    try:
        raw = base64.b64decode(parent.recv())
        named = load_serialized_named_tensors(raw, None)
        got = named["w"].clone()
        assert got.is_cuda and torch.equal(got.cpu(), torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5)
    finally:
        parent.send("done")
        proc.join(60)
