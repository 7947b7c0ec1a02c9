"""Test data of the tokenizer (tests/tokenizer/tokenizer_test.cpp), made with Hugging Face `tokenizers`.

  python3 tools/tokenizer/make_test_data.py [OUT_DIR]     (default tests/data/tokenizer)

Needs the PyPI package `tokenizers` (pip install tokenizers). The script
  1. generates a training text of its own (English, accented Latin, CJK, emoji, digits, code,
     whitespace runs, newlines; a fixed seed, so the same text every time),
  2. TRAINS a small byte-level BPE tokenizer on it: vocabulary 800, the GLM-4 / GLM-5 family's
     pre-tokenizer (Split with the regex below, behaviour Isolated, then ByteLevel without the
     prefix space and without its own regex), ByteLevel decoder, special tokens [gMASK], <sop>,
     <|endoftext|> and more added tokens, a TemplateProcessing post-processor "[gMASK] <sop> $A",
  3. writes OUT_DIR/tokenizer.json (the trained tokenizer), OUT_DIR/tokenizer_config.json (names
     the EOS token, as a Hugging Face model directory does) and OUT_DIR/cases.json: texts with the
     ids `tokenizers` gives them (without and with the post-processor's special tokens), the
     pieces its pre-tokenizer cuts them into, the text it decodes them to (with and without
     special tokens, where that is not the text), id lists to decode, and variants: a
     JSON merge patch of tokenizer.json (another pre-tokenizer, ignore_merges, ...) with the ids the
     patched tokenizer gives.
The output depends only on this script and the `tokenizers` version (recorded in cases.json).
"""
import json
import os
import random
import sys

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

GLM_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB_SIZE = 800

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "tokenizer")
os.makedirs(out_dir, exist_ok=True)


# ---- 1. the training text ------------------------------------------------------------------
def training_text(rng):
    english = ("the quick brown fox jumps over the lazy dog while the model learns to read "
               "a tokenizer splits text into pieces and merges frequent pairs of bytes into tokens "
               "it's we're they've I'm you'll he'd don't can't THE RESULT IS WHAT IT IS").split()
    latin = ("café naïve résumé crème brûlée façade Straße Grüße über Ölfässer año "
             "niño señor corazón ação coração São Paulo Łódź Kraków Dvořák").split()
    cjk = ["你好", "世界", "这是", "一个", "测试", "中文", "分词器", "模型", "训练",
           "日本語", "の", "テキスト", "です", "ひらがな", "カタカナ", "한국어", "안녕하세요", "텍스트"]
    emoji = ["🙂", "👍", "👍🏽", "🎉", "🚀", "❤️", "👨\u200d👩\u200d👧", "🇫🇷", "✨"]
    code = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {\n  sum += a[i];\n}\n",
            "if x != None and y >= 3:\n\tprint('ok')\n", "#include <vector>\n", "x = {\"key\": [1, 2, 3]}\n",
            "// comment: TODO(fix)\n", "SELECT * FROM t WHERE id = 42;\n"]
    spaces = [" ", "  ", "   ", "    ", "\t", "\n", "\n\n", "\r\n", " \n", "\n    "]
    parts = []
    for _ in range(6000):
        r = rng.random()
        if r < 0.45:
            w = rng.choice(english)
            parts.append(w.capitalize() if rng.random() < 0.1 else w)
        elif r < 0.6:
            parts.append(rng.choice(latin))
        elif r < 0.72:
            parts.append("".join(rng.choice(cjk) for _ in range(rng.randint(1, 4))))
        elif r < 0.77:
            parts.append(rng.choice(emoji))
        elif r < 0.85:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        elif r < 0.9:
            parts.append(rng.choice(code))
        else:
            parts.append(rng.choice([",", ".", "!", "?", ";", ":", "...", "(", ")", "\"", "'", "-"]))
        parts.append(rng.choice(spaces) if rng.random() < 0.25 else " ")
    text = "".join(parts)
    return [text[i:i + 2000] for i in range(0, len(text), 2000)]


rng = random.Random(20240531)
corpus = training_text(rng)

# ---- 2. the tokenizer ----------------------------------------------------------------------
SPECIAL = ["[gMASK]", "<sop>", "<|endoftext|>", "<|user|>", "<|assistant|>"]
tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
tok.normalizer = None
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(GLM_REGEX), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
])
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False)
tok.train_from_iterator(corpus, trainer)
# More added tokens after training: non-special ones (decoded even when special tokens are skipped;
# one matched on the raw text, one on the normalized text) and a special token that swallows the
# whitespace on its left and right.
tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                AddedToken("</think>", special=False, normalized=True)])
tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True, special=True,
                                   normalized=False)])
gmask, sop = tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")
tok.post_processor = processors.TemplateProcessing(
    single="[gMASK] <sop> $A", pair="[gMASK] <sop> $A $B",
    special_tokens=[("[gMASK]", gmask), ("<sop>", sop)])
tok_json = json.loads(tok.to_str())


# ---- 3. the cases --------------------------------------------------------------------------
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = bytes_to_unicode()

long_mixed = corpus[3][:600] + " <|endoftext|> " + corpus[7][:600]
texts = [
    "", " ", "    ", "\n", "\r\n", "\t", " \n \n  ", "\n\n\n", "a", "Hello world",
    "Hello, world! It's a test. I'LL DO IT; you'd've THEY'RE here 'S 'ſ",
    "the quick brown fox jumps over the lazy dog",
    "[gMASK]<sop>Hello<|endoftext|>",
    "text with <|endoftext|> inside and [gMASK] twice [gMASK][gMASK] end",
    "<|user|>\nWhat is 2+2?<|assistant|>\n4<|endoftext|>",
    "partial <|endoftext| <sop [gMASK <|user|",
    "<think>reasoning here</think> answer",
    "hello   <mask>   world <mask>",
    "12345678901234567890", "3.14159 and 1,000,000 and 007", "٣٤٥ ١٢ and ⅷ ² ½",
    "naïve café résumé Straße ÀÉÎÕÜ Łódź",
    "e\u0301 vs é (decomposed and composed)",
    "你好，世界！这是一个测试。", "日本語のテキストです。", "안녕하세요 한국어",
    "👍🏽 👨\u200d👩\u200d👧 🎉🎉 🇫🇷 ❤️",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n  sum += a[i];\r\n}",
    "a    b\t\tc  \n\n  d   ",
    "nbsp\u00a0here, ideographic\u3000space, line\u2028sep, mongolian\u180evowel, nel\u0085x",
    "zero\u200bwidth \ufeffbom \ufffd replacement",
    "nul\x00and\x01control\x7f chars",
    "Ġ and Ċ are the byte-level space and newline; ĠĠhello",
    "\\x80 \\xff is not a byte",
    "rare 𠀀𪚥 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "İstanbul ıi ǅ ß ẞ",
    # Where Oniguruma's \s (White_Space) and PCRE2's differ: U+0085 is White_Space, U+180E is not.
    "!\u0085 a\u0085\u0085 b x\u180e\u180e y !\u180e\u180e ?\u3000\u3000z !\u00a0 \u200b\u200b !",
    "end with spaces \u2028\u2029\u0085 ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!???... ,,, ---- ====",
    long_mixed,
]

def encode(t, text, specials=False):
    return t.encode(text, add_special_tokens=specials).ids


cases = []
for text in texts:
    ids = encode(tok, text)
    case = {"text": text, "ids": ids, "ids_with_specials": encode(tok, text, True),
            "pieces": [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]}
    # What tokenizers decodes the ids to, when that is not the text itself.
    decoded = tok.decode(ids, skip_special_tokens=False)
    skip = tok.decode(ids, skip_special_tokens=True)
    if decoded != text:
        case["decoded"] = decoded
    if skip != text:
        case["decoded_skip_special"] = skip
    cases.append(case)

# Id lists to decode: bytes that are not UTF-8 on their own (decoded with U+FFFD).
vocab = tok.get_vocab()
def byte_id(b):
    return vocab[B2U[b]]
decode_cases = []
for ids in ([byte_id(0xE4)], [byte_id(0xE4), byte_id(0xBD)], [byte_id(0xE4), byte_id(0x41)],
            [byte_id(0x80), byte_id(0x80), byte_id(0xFF)], [byte_id(0xF0), byte_id(0x9F), byte_id(0x98)],
            [byte_id(0xC0), byte_id(0xAF)], [byte_id(0xED), byte_id(0xA0), byte_id(0x80)],
            [gmask, byte_id(0xE4), sop, byte_id(0xBD), byte_id(0xA0)],
            [vocab["<think>"], byte_id(0x41), vocab["<mask>"]]):
    decode_cases.append({"ids": ids,
                         "decoded": tok.decode(ids, skip_special_tokens=False),
                         "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})


# Variants: a merge patch of tokenizer.json and the ids of the patched tokenizer.
def byte_level(prefix, regex):
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": True, "use_regex": regex}


def split(pattern, behavior, invert=False, kind="Regex"):
    return {"type": "Split", "pattern": {kind: pattern}, "behavior": behavior, "invert": invert}


variant_texts = ["Hello world, it's me!", "  leading and trailing  ", "a,b,,c. d!e? ", "x", "",
                 "zzzzqq", "the zzzzqq", "你好，世界! 42 apples, 7 pears", "[gMASK]Hi<sop> there <mask> you",
                 "line one\nline two\r\n\tindented, 12345", "...", "a  \n  b  \n\n c\r\n  d  "]
variant_patches = {
    "gpt2_byte_level": {"pre_tokenizer": byte_level(True, True)},
    "byte_level_regex_only": {"pre_tokenizer": byte_level(False, True)},
    "byte_level_prefix_space": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(GLM_REGEX, "Isolated"), byte_level(True, False)]}},
    "split_removed": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(r"\s+", "Removed"), byte_level(False, False)]}},
    "split_merged_with_previous": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(r"[,.!?]", "MergedWithPrevious"), byte_level(False, False)]}},
    "split_merged_with_next": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(r"[,.!?]", "MergedWithNext"), byte_level(False, False)]}},
    "split_contiguous": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(r"[,.!?]", "Contiguous"), byte_level(False, False)]}},
    "split_isolated_inverted": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(r"\p{L}+", "Isolated", invert=True), byte_level(False, False)]}},
    "split_removed_inverted": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(r"\p{L}+", "Removed", invert=True), byte_level(False, False)]}},
    # ^ and $ (line anchors in Ruby syntax) and the dot (no newline).
    "split_anchors": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(r"^\s+|\s+$|^.", "Removed"), byte_level(False, False)]}},
    "split_string_pattern": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        split(", ", "Isolated", kind="String"), byte_level(False, False)]}},
    # "zzzzqq" is added to the vocabulary without a merge that builds it: with ignore_merges the
    # whole word is that token, without it the merges spell it out. (The vocabulary then has 801
    # entries: tokenizers gives the added tokens that are not in it the ids 801, 802, 803, not the
    # ids 800..802 the file names.)
    "nfc": {"normalizer": {"type": "NFC"}},
    "nfc_sequence": {"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]}},
    "ignore_merges": {"model": {"ignore_merges": True, "vocab": {"zzzzqq": 900}}},
    "unreachable_token": {"model": {"ignore_merges": False, "vocab": {"zzzzqq": 900}}},
    "no_post_processor": {"post_processor": None},
    "byte_level_post_processor": {"post_processor": byte_level(True, False)},
}


def merge_patch(target, patch):
    """A merge patch where null sets null (tests/tokenizer/tokenizer_test.cpp applies the same)."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return patch
    target = dict(target)
    for k, v in patch.items():
        target[k] = merge_patch(target.get(k), v)
    return target


# Texts NFC changes: decomposed accents, the Angstrom and Ohm signs, Hangul jamo, an accent after
# an added token (normalized apart from it) and before one matched after normalization.
nfc_texts = ["cafe\u0301 re\u0301sume\u0301 \u212b \u2126 \u1100\u1161\u11a8",
             "<think>\u0301x</think>\u0301 a\u0308</think>", "\ufb01 \u00c5 A\u030a"]

variants = []
for name, patch in variant_patches.items():
    t = Tokenizer.from_str(json.dumps(merge_patch(tok_json, patch)))
    texts_v = variant_texts + (nfc_texts if name.startswith("nfc") else [])
    variants.append({"name": name, "patch": patch, "cases": [
        {"text": text, "ids": encode(t, text), "ids_with_specials": encode(t, text, True)}
        for text in texts_v]})
with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
    f.write(tok.to_str(pretty=False))
    f.write("\n")
with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>", "bos_token": None}, f, indent=2)
    f.write("\n")
def dumps(v):
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


# cases.json with one case per line (readable diffs when the data is made again).
with open(os.path.join(out_dir, "cases.json"), "w", encoding="utf-8") as f:
    f.write("{\n")
    f.write(f'"generator":{dumps("tools/tokenizer/make_test_data.py")},\n')
    f.write(f'"tokenizers_version":{dumps(tokenizers.__version__)},\n')
    f.write(f'"vocab_size":{tok.get_vocab_size(with_added_tokens=True)},\n')
    f.write('"cases":[\n' + ",\n".join(dumps(c) for c in cases) + "],\n")
    f.write('"decode_cases":[\n' + ",\n".join(dumps(c) for c in decode_cases) + "],\n")
    f.write('"variants":[\n' + ",\n".join(
        f'{{"name":{dumps(v["name"])},"patch":{dumps(v["patch"])},"cases":[\n' +
        ",\n".join(dumps(c) for c in v["cases"]) + "]}" for v in variants) + "]\n")
    f.write("}\n")
print(f"wrote {out_dir}: vocab {tok.get_vocab_size(with_added_tokens=True)}, {len(cases)} cases, "
      f"{len(decode_cases)} decode cases, {len(variants)} variants "
      f"({sum(len(v['cases']) for v in variants)} cases)")
