"""Media bytes -> the arrays a tower reads (docs/multimodal.md): decoding with the field's libraries (Pillow for
images), the resize rules and token counts, and nothing of the model. `image.py` for images."""
