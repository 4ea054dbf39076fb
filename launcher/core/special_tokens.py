"""The special tokens a tokenizer's vocabulary is searched for when its config names none: the
end-of-document (end-of-text, eos) and beginning-of-sequence spellings of the common families,
first match wins (data_prep's shards and the chat templates' end-of-turn fallback)."""

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
