"""The shapes world: GenEval-like prompts about coloured shapes, scenes, a renderer and a verifier.

    rng = np.random.default_rng(0)
    scene = sample_scene(rng, split="train")      # a prompt and a layout that satisfies it
    image = render(scene, size=32)                # uint8 [32, 32, 3]
    verdict = verify(image, prompt_for(scene))    # Verdict(correct, score, surplus_objects, details); .strict
"""

from .prompts import CATEGORIES, SPLITS, all_prompts, category_of, parse_prompt, prompt_for, split_prompts
from .render import render
from .scene import Scene, SceneObject, sample_scene, scene_for
from .spec import ObjectGroup, Spec
from .verify import Verdict, verify, verify_batch
from .vocab import BACKGROUND, COLOURS, RELATIONS, SHAPES, VOCABULARY

__all__ = [
    "BACKGROUND",
    "CATEGORIES",
    "COLOURS",
    "ObjectGroup",
    "RELATIONS",
    "SHAPES",
    "SPLITS",
    "Scene",
    "SceneObject",
    "Spec",
    "VOCABULARY",
    "Verdict",
    "all_prompts",
    "category_of",
    "parse_prompt",
    "prompt_for",
    "render",
    "sample_scene",
    "scene_for",
    "split_prompts",
    "verify",
    "verify_batch",
]
