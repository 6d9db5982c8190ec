"""Images for vision-language models, torch-free (the frontend's and the offline API's): decoding with
bounds (image_decode.py), Idefics3's preprocessing (idefics3.py) and the prompt's expansion (processor.py)."""
