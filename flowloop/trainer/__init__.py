"""Training: pretraining of the embedded model, evaluation, and (later) the FlowGRPO recipe."""
