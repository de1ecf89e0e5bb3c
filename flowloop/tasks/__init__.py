"""Tasks: what prompts train and validate, and how a validation sample is scored.

`Task` is the interface the recipe speaks (`flowloop.tasks.base`); `shapes` is the embedded
default with a verifiable reward (see DESIGN.md), `prompt_file` trains on a file's prompts with
any reward. ``data.task`` picks one by name.
"""

from flowloop.tasks.base import Grid, Task, build_task, register_task, registered_tasks, task_name
from flowloop.tasks.prompt_file import PromptFileTask, load_prompt_file
from flowloop.tasks.shapes.task import ShapesTask

__all__ = ["Grid", "PromptFileTask", "ShapesTask", "Task", "build_task", "load_prompt_file", "register_task",
           "registered_tasks", "task_name"]
