"""Images into the engine (vision-language models).

On the caller's thread (RequestIntake.prepare): the images are checked (images.py),
read by the checkpoint's own transformers image processor and hashed, and each
image's placeholder token in the prompt becomes as many tokens as the image has
(processor.py, one per model family). The request then carries MultiModalInputs
(inputs.py). In the engine the scheduler decides which images the vision tower runs
in a step, under a budget, and which outputs stay cached by content hash
(backend/engine/scheduling/encoder_cache.py); the runner runs it and puts the rows in
place of the placeholders (backend/engine/runner/mm_step.py).
"""
