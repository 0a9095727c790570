"""Parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs): process groups and rank launch,
tensor-parallel attention, expert parallelism with EPLB placement, context parallelism."""
