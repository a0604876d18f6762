"""Text, JSON lines, Parquet, Arrow or a `datasets` folder -> a Megatron-Core indexed dataset (PREFIX.bin/.idx/.json).

    .venv/bin/python tools/preprocess_data.py --input FILE_GLOB_OR_FOLDER [...] --output-prefix PREFIX \\
        --tokenizer byte|PATH [--text-key text] [--workers N]

    .venv/bin/python tools/preprocess_data.py --input 'corpus/*.txt' --output-prefix data/corpus --tokenizer byte
    .venv/bin/python tools/preprocess_data.py --input 'fineweb/*.parquet' --output-prefix data/web --tokenizer tok/ \
        --workers 8
    .venv/bin/python tools/preprocess_data.py --input saved_ds/train web.jsonl.zst --output-prefix data/mix \
        --tokenizer tok/
    .venv/bin/python tools/preprocess_data.py --format sft --input chats.jsonl --output-prefix data/chats \
        --tokenizer hf_model/
    .venv/bin/python tools/preprocess_data.py --format preference --input pairs.jsonl --output-prefix data/pairs \
        --tokenizer hf_model/

Inputs (files in the order given, each glob's matches sorted; training/data/sources.py reads them): plain text
(a document per line), .jsonl/.json (a JSON object per line, the document in --text-key), either compressed as
.gz or .zst, .parquet, .arrow and .csv/.tsv files (the --text-key column), and a Hugging Face `datasets` folder
written by save_to_disk. Parquet, Arrow, CSV and .zst need `pip install -e '.[data]'`. Blank lines and empty
documents are skipped; each document ends with the tokenizer's end-of-document token. PREFIX.json records the
tokenizer, so training refuses to read the data with another one: train with `data.paths=[PREFIX]
data.tokenizer=<the same>`.
Parts preprocessed apart are joined with tools/merge_datasets.py.

--format sft: conversations for fine-tuning (data.format=sft), a record per JSON line or Parquet/Arrow row:
{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}, ShareGPT's {"conversations": [{"from":
"system"|"human"|"gpt", "value": ...}, ...]}, {"prompt": ..., "completion": ...}, or Alpaca's {"instruction": ...,
"input": ..., "output": ...} (the user turn: the instruction, a newline and the input, or the instruction alone when
the input is empty; these two take an optional "system"), rendered with the chat template of --tokenizer (a Hugging
Face tokenizer directory).
Writes PREFIX.bin/.idx (each conversation's token ids, nothing appended), PREFIX.mask.bin/.idx (1 on the assistant's
tokens: the loss targets) and PREFIX.json; empty records are skipped and counted (training/data/chat.py).

--format preference: pairs for preference tuning (data.format=preference, post=dpo; docs/preference.md):
{"prompt": str, "chosen": str, "rejected": str[, "system": str]}, TRL's conversational {"prompt": [messages],
"chosen": [messages], "rejected": [messages]}, or UltraFeedback-binarized's whole conversations {"chosen":
[messages], "rejected": [messages]}; each pair is two conversations (chosen, then rejected) with the mask on the
last answer (training/post/records.py). A malformed record is one line naming file:line.

Progress over all inputs (file i/N, documents/s, MB/s of input, ETA) goes to stderr about once a second, a
summary to stdout. Problems are one line (`error: ...`, naming the file, and the line where it has lines; an
unknown or damaged input says what it is and what is supported) and exit code 2.
"""

import argparse
import contextlib
import json
import logging
import multiprocessing
import sys
import time
import warnings
from pathlib import Path

import numpy as np

# Light imports only: worker processes start before torch / Megatron-Core are imported (training.data.datasets),
# and training.data.sources imports pyarrow only for Parquet / Arrow inputs.
from training.data import chat, decode, sft_write, sources
from training.data.tokenizer import ByteTokenizer, build_tokenizer
from training.errors import ConfigError, TemplateError, exit_on_error

_tokenizer = None  # one per worker process, built by init_worker (tokenizers need not pickle)


def load_tokenizer(spec: str, data_format: str = "text"):
    """--tokenizer for --format: build_tokenizer's, or a chat template's (training/data/chat.py) for sft; for
    preference, a directory's chat template, or plain text (`byte`, a tokenizer.json: training/post/records.py)."""
    if data_format == "preference" and not Path(spec).is_dir():
        from training.post.records import PlainTokenizer

        return PlainTokenizer(build_tokenizer(spec))
    return chat.ChatTokenizer(spec) if data_format in ("sft", "preference") else build_tokenizer(spec)


def init_worker(spec: str, data_format: str = "text") -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(spec, data_format)


def encode_chunk(chunk: sources.Chunk) -> tuple[list[np.ndarray], int, int, int]:
    """Worker: a chunk -> (token ids per document, its source index, input bytes on disk, bytes of text).

    Arrays, not lists: they pickle back to the parent as one memory copy instead of one object per token (which
    made 2 workers slower than 1)."""
    docs = [token_ids(_tokenizer, t) for t in decode.texts(chunk)]
    return docs, chunk.index, chunk.disk_bytes, chunk.text_bytes


def encode_conversations(chunk: sources.Chunk) -> tuple[list, int, int, int]:
    """Worker (--format sft): a chunk -> ((token ids, loss mask) per record, None for an empty one, its source
    index, input bytes on disk, bytes of text)."""
    found = []
    for number, record in decode.records(chunk):
        messages = chat.conversation(record, chunk.path, number)
        found.append(None if messages is None else chat.encode(_tokenizer, messages, f"{chunk.path}:{number}"))
    return found, chunk.index, chunk.disk_bytes, chunk.text_bytes


def encode_preferences(chunk: sources.Chunk) -> tuple[list, int, int, int]:
    """Worker (--format preference): a chunk -> its pairs as (ids, mask) conversations, chosen then rejected
    (training/post/records.py), its source index, input bytes on disk, bytes of text."""
    from training.post import records

    found = []
    for number, record in decode.records(chunk):
        found += records.encode_pair(_tokenizer, record, chunk.path, number)
    return found, chunk.index, chunk.disk_bytes, chunk.text_bytes


def token_ids(tokenizer, text: str) -> np.ndarray:
    """tokenizer.encode(text) as uint16 where the vocabulary fits (half the bytes of int32 to pickle back to the
    parent), else int32; the byte tokenizer's ids are the UTF-8 bytes themselves, taken without a list of Python
    ints (converting that list was ~60% of the time on a byte-tokenized Parquet input)."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
    return np.asarray(tokenizer.encode(text), dtype=dtype)


class Progress:
    """Counts documents, tokens and input bytes over every input; prints a line to stderr at most every `every` s:
    which file, how much of the input (on disk) is done, the rates and the time left."""

    def __init__(self, inputs: list[sources.Source], every: float = 1.0, unit: str = "documents"):
        self.start = self.last = time.monotonic()
        self.unit = unit  # what a record is called: documents, or conversations (--format sft)
        self.files, self.total = len(inputs), sum(s.size for s in inputs)
        self.every, self.file, self.documents, self.tokens, self.bytes, self.text = every, 0, 0, 0, 0, 0

    def update(self, file: int, documents: int, tokens: int, nbytes: int, text: int) -> None:
        self.file, self.documents, self.tokens = file, self.documents + documents, self.tokens + tokens
        self.bytes, self.text = self.bytes + nbytes, self.text + text
        if time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            print(self.line(final=False), file=sys.stderr, flush=True)

    def line(self, final: bool = True) -> str:
        seconds = max(time.monotonic() - self.start, 1e-9)
        mb, rate = self.bytes / 1e6, self.bytes / seconds
        of_text = f", {self.text / 1e6 / seconds:.2f} MB/s of text" if self.text != self.bytes else ""
        rates = f"{self.documents / seconds:.0f} {self.unit}/s, {mb / seconds:.2f} MB/s{of_text}"
        if final:
            return f"{self.documents} {self.unit}, {mb:.1f} MB in {seconds:.1f} s ({rates})"
        eta = f"{(self.total - self.bytes) / rate:.0f} s" if rate > 0 else "?"
        return (f"file {self.file + 1}/{self.files}: {self.documents} {self.unit}, {mb:.1f}/{self.total / 1e6:.1f} MB "
                f"({100 * self.bytes / max(self.total, 1):.0f}%) in {seconds:.1f} s, {rates}, ETA {eta}")


def documents(results, progress: Progress, inputs: list[sources.Source]):
    """Flatten chunk results into one document stream, counting as it goes; an input without documents is an
    error named by its files (raised inside write_indexed, which cleans up)."""
    for docs, file, nbytes, text in results:
        progress.update(file, len(docs), sum(len(d) + 1 for d in docs), nbytes, text)  # + 1: the EOD added
        yield from docs
    if progress.documents == 0:
        names = inputs[0].path if len(inputs) == 1 else f"{len(inputs)} files ({inputs[0].path}, ...)"
        raise ConfigError(f"no documents in {names}: empty, or only blank lines")


def conversations(results, progress: Progress, inputs: list[sources.Source]):
    """--format sft: the (ids, mask) pairs in order (None: an empty record, which write_sft counts), counting the
    conversations as it goes; an input without any is an error named by its files."""
    for pairs, file, nbytes, text in results:
        found = [pair for pair in pairs if pair is not None]
        progress.update(file, len(found), sum(len(ids) for ids, _ in found), nbytes, text)
        yield from pairs
    if progress.documents == 0:
        names = inputs[0].path if len(inputs) == 1 else f"{len(inputs)} files ({inputs[0].path}, ...)"
        raise ConfigError(f"no conversations in {names}: empty, or only blank lines and empty records")


def preprocess(inputs: list[sources.Source], prefix: str, tokenizer, spec: str, text_key: str | None,
               workers: int, data_format: str = "text") -> Progress:
    """Encode `inputs` on `workers` processes (imap: results in input order) and write the dataset. The parent
    reads (one ~1 MB chunk at a time, a Parquet row group at most) and writes; the workers decode and encode.
    data_format sft: whole records (text_key None), conversations written with their loss masks."""
    global _tokenizer
    sft = data_format in ("sft", "preference")  # records, written with their loss masks
    tasks = sources.chunks(inputs, None if sft else text_key)
    with contextlib.ExitStack() as stack:
        # The pool starts before training.data.datasets imports torch and Megatron-Core (~10 s on 2 cores): forking
        # a process without torch's threads is safe and cheap, and spawn-started workers import only this
        # light module.
        # (--format sft: transformers has imported torch already, in the parent's ChatTokenizer; no thread yet.)
        pool = stack.enter_context(multiprocessing.Pool(workers, init_worker, (spec, data_format))) \
            if workers > 1 else None
        write_indexed = import_write_indexed()
        progress = Progress(inputs, unit="conversations" if sft else "documents")  # after the imports: the
        if pool is None:                                                           # rates measure the work
            _tokenizer = tokenizer
        work = {"sft": encode_conversations, "preference": encode_preferences}.get(data_format, encode_chunk)
        results = pool.imap(work, tasks) if pool else map(work, tasks)
        if sft:
            sft_write.write_sft(prefix, conversations(results, progress, inputs), tokenizer, data_format)
        else:
            write_indexed(prefix, documents(results, progress, inputs), tokenizer)
    return progress


def import_write_indexed():
    """training.data.datasets.write_indexed, without Megatron-Core's import-time notices (TE/Apex fallbacks, rank
    guesses, no CUDA runtime) that say nothing about writing a dataset (sft_write.write_sft imports the same)."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"megatron\.")
        from megatron.core.datasets import indexed_dataset  # noqa: F401 - imported here, under the filter

        from training.data.datasets import write_indexed
    return write_indexed


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="files, globs (quote them) or `datasets` save_to_disk folders")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    parser.add_argument("--tokenizer", required=True, help="byte, or a tokenizer.json (or its directory); "
                        "--format sft: a Hugging Face tokenizer directory with a chat template")
    parser.add_argument("--format", dest="data_format", choices=("text", "sft", "preference"), default="text",
                        help="text: documents; sft: conversations with the loss on the answers (data.format=sft); "
                             "preference: {prompt, chosen, rejected} pairs (data.format=preference, post=dpo)")
    parser.add_argument("--text-key", "--json-key", dest="text_key", default=None,
                        help="the document: a .jsonl/.json field, a Parquet/Arrow column (default text; --json-key: "
                             "the old name); not with --format sft")
    parser.add_argument("--workers", type=int, default=1, help="encoding processes (use the cores for big inputs)")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.workers < 1:
        raise ConfigError(f"--workers={args.workers}: must be at least 1")
    if Path(args.output_prefix).suffix in (".bin", ".idx", ".json"):
        raise ConfigError(f"--output-prefix {args.output_prefix}: give the prefix, without "
                          f"{Path(args.output_prefix).suffix}")
    sft = args.data_format in ("sft", "preference")
    if sft and args.text_key is not None:
        raise ConfigError(f"--text-key {args.text_key} names the document of --format text; --format sft reads each "
                          f"record's \"messages\" (or \"conversations\", or \"prompt\" and \"completion\")")
    args.text_key = args.text_key or "text"
    tokenizer = load_tokenizer(args.tokenizer, args.data_format)  # in the parent first: fails before any work
    inputs = sources.resolve(args.input, None if sft else args.text_key)  # every input found and checked first
    try:
        progress = preprocess(inputs, args.output_prefix, tokenizer, args.tokenizer, args.text_key, args.workers,
                              args.data_format)
    except OSError as err:  # an unreadable input, an unwritable output folder
        raise TemplateError(f"{err.filename}: {err.strerror}" if err.filename else str(err)) from err
    if sft:  # conversations or pairs
        meta = json.loads(Path(f"{args.output_prefix}.json").read_text())
        counted = f"{meta['documents'] // 2} pairs" if args.data_format == "preference" else \
            f"{meta['documents']} conversations"
        skipped = "" if args.data_format == "preference" else f", {meta['dropped']} empty records skipped"
        print(f"wrote {args.output_prefix}.bin/.idx/.json and {chat.mask_prefix(args.output_prefix)}.bin/.idx "
              f"({counted}, {meta['tokens']} tokens, {meta['answer_tokens']} answer tokens{skipped}; tokenizer "
              f"{tokenizer.name}, chat template {meta['chat_template']}) from {len(inputs)} file(s): {progress.line()}")
        return 0
    print(f"wrote {args.output_prefix}.bin/.idx/.json ({progress.tokens} tokens, tokenizer {tokenizer.name}) "
          f"from {len(inputs)} file(s): {progress.line()}")
    return 0


def main(argv: list[str]) -> int:
    """run(argv), with the user's errors as one line each and exit code 2."""
    return exit_on_error(run, argv)


if __name__ == "__main__":  # the guard also keeps spawn-started workers from re-running main
    sys.exit(main(sys.argv[1:]))
