"""A worker group: the processes that hold one model's shards and step together (tensor and expert
parallelism). comm.py is how they talk: torch.distributed (gloo on CPU, NCCL on GPUs) and, between
processes of one CPU host, a shared-memory exchange (shm.py) for the small collectives a step is
made of."""
