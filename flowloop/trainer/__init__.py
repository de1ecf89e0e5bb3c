"""Training: pretraining of the embedded model, evaluation, and the FlowGRPO building blocks
(`advantages`, `losses`, `checkpoint`, `metrics_log`) that the RL recipe wires together."""
