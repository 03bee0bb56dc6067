"""`dgemma::moe_experts`: the routed experts of one MoE layer (`op.py`) and their stored weight formats
(`formats.py`)."""
