"""The ids SentencePiece reserves in every vocabulary this project trains (input_pipeline/tokenizer.py)."""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
