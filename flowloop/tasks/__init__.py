"""Tasks with verifiable rewards; `shapes` is the embedded default (see DESIGN.md)."""
