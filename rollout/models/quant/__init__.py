"""Quantized weight formats: how a checkpoint stores a weight in fewer bits and how to turn it back
into the float tensor a model holds (MXFP4 for gpt-oss experts: `rollout.models.quant.mxfp4`)."""
