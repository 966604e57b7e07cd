"""Media bytes -> the arrays a tower reads (docs/multimodal.md): decoding with the field's libraries (Pillow for
images, soundfile/soxr/PyAV for audio, PyAV for video), the resize rules and token counts, and nothing of the
model. `image.py` for images, `audio.py` for audio, `video.py` for video."""
