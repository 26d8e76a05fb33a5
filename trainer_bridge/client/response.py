"""A ``/generate`` response read into a ``Sample``: routing decoded, every field checked."""
from __future__ import annotations

import torch

from capture.codec import decode_routed_experts

from ..sample import Sample
from .errors import SampleError, _Aborted, _ServerFailed
from .model_info import ModelInfo
from .request import Request


def decode_routing(s: str, info: ModelInfo, rid: str, url: str) -> torch.Tensor:
    """A ``routed_experts`` string -> ``[rows, num_layers, top_k]`` int32."""
    try:
        # NOTE: fmt=None reads the format from the payload, not from what was asked for: a server
        # that ignores routed_experts_format (real SGLang) answers int32
        return decode_routed_experts(s, num_layers=info.num_layers, top_k=info.top_k)
    except ValueError as exc:
        raise SampleError(f"sample {rid!r} from {url}: undecodable routed_experts: {exc}") from None


def to_sample(req: Request, out: dict, url: str, *, info: ModelInfo, aborted: set[str],
              return_routed_experts: bool, validate: bool, attempts: int, latency: float, nbytes: int) -> Sample:
    """The sample in ``out`` (a ``/generate`` response, or one assembled from a stream).

    ``aborted``: the rids this client aborted itself; an abort of any other rid raises
    ``_Aborted`` (submit it again). An abort the server reports as its own failure (``err_type``)
    raises ``_ServerFailed``.
    """
    who = f"sample {req.rid!r} from {url}"
    try:
        meta = out["meta_info"]
        output_ids = [int(t) for t in out["output_ids"]]
        finish = meta["finish_reason"] or {}
        finish_type = finish.get("type") if isinstance(finish, dict) else str(finish)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SampleError(f"{who}: malformed response ({type(exc).__name__}: {exc})") from None
    if meta.get("id") not in (None, req.rid):
        raise SampleError(f"{who}: response is for rid {meta.get('id')!r}")
    if finish_type == "abort" and isinstance(finish, dict) and finish.get("err_type"):
        # NOTE: the server failed the request (e.g. non-finite logits): a failed attempt, not a pause
        raise _ServerFailed(f"request aborted by a server error: {str(finish.get('message'))[:200]}",
                            dead=False)
    if finish_type == "abort" and req.rid not in aborted:
        raise _Aborted()
    aborted.discard(req.rid)
    if meta.get("prompt_tokens") is not None and int(meta["prompt_tokens"]) != len(req.input_ids):
        raise SampleError(f"{who}: prompt_tokens {meta['prompt_tokens']} != {len(req.input_ids)} sent")
    lp_rows = meta.get("output_token_logprobs") or []
    if [int(t) for _lp, t, *_ in lp_rows] != output_ids:
        raise SampleError(f"{who}: output_token_logprobs do not match output_ids")
    lps = [float(lp) for lp, *_ in lp_rows]
    routed = None
    routing_bytes = 0
    if return_routed_experts:
        if "_routing" in out:
            routed = out["_routing"]
        elif finish_type == "abort" and not output_ids and not meta.get("routed_experts"):
            # NOTE: aborted before any KV was computed (SGLang's "Abort before prefill"): no routing
            # row exists and the server sends no routed_experts (docs/protocol.md). Told by the
            # field's absence, never by the wording of finish_reason.message.
            routed = None
        elif meta.get("routed_experts") is not None:
            routing_bytes = len(meta["routed_experts"])
            routed = decode_routing(meta["routed_experts"], info, req.rid, url)
        else:
            raise SampleError(f"{who}: no routed_experts in the response (is the server started with "
                              f"--enable-return-routed-experts?)")
        start = int(meta.get("routed_experts_start_len") or 0)
        if start != 0:
            raise SampleError(f"{who}: routed_experts_start_len {start}, expected 0")
    sample = Sample(prompt_ids=req.input_ids, response_ids=output_ids, rollout_logprobs=lps,
                    routed_experts=routed, weight_version=meta.get("weight_version"),
                    weight_versions=meta.get("weight_versions"),
                    group_id=req.group_id, rid=req.rid,
                    meta={**req.meta, "finish_reason": finish_type, "server": url, "attempts": attempts,
                          "latency_s": latency, "wire_bytes": nbytes, "routing_bytes": routing_bytes,
                          "text": out.get("text", ""), "cached_tokens": meta.get("cached_tokens", 0)})
    if validate and routed is not None:
        try:
            sample.validate(info.num_experts, info.num_layers, info.top_k,
                            list(info.moe_layers) if info.moe_layers else None)
        except ValueError as exc:
            raise SampleError(f"{exc} (from {url})") from None
    return sample
