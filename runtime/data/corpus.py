"""The bundled corpus: English-like text generated deterministically by this file (ours to redistribute).

Nothing is downloaded or stored: `corpus_tokens()` regenerates the same ~1 MiB of text on first use
in each process (about a quarter of a second) and caches it in memory. The tokenizer is byte-level:
token id = UTF-8 byte, vocabulary 256 (the text is ASCII, so only ids < 128 occur).

The text has structure at several scales, so a small model's loss falls visibly within a few hundred
steps and keeps falling: frequent words and spelling (bytes -> words), a small grammar (word order,
agreement with a person's pronoun), arithmetic facts (exact answers), counting sequences, and a fixed
table of facts about people that recurs in sentences and in key-value records (memorization).

Randomness uses only `random.Random(seed).random()`, whose stream Python guarantees to be
reproducible across versions; a test pins the hash of the output.
"""

import functools
import random

import numpy as np

VOCAB_SIZE = 256  # byte-level tokenizer
DEFAULT_BYTES = 1 << 20
DEFAULT_SEED = 1234

NAMES = ("alice", "bruno", "chen", "dara", "emil", "fatima", "goran", "hana", "ines", "jonas", "kofi",
         "lena", "mateo", "nadia", "oskar", "priya", "quinn", "rosa", "samir", "tove", "uma", "viktor",
         "wen", "xenia", "yusuf", "zoe")
CITIES = ("paris", "lagos", "lima", "oslo", "kyoto", "cairo", "quito", "perth", "turin", "hanoi", "dakar",
          "porto")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")
PETS = ("cat", "dog", "parrot", "rabbit", "turtle", "goldfish", "hamster")
ADJECTIVES = ("small", "old", "bright", "quiet", "heavy", "round", "wooden", "tall", "broken", "shiny")
NOUNS = ("box", "lamp", "book", "chair", "kettle", "window", "garden", "bridge", "letter", "basket")
PLACES = ("kitchen", "market", "station", "library", "harbor", "school", "forest", "museum")
VERBS = ("found", "painted", "carried", "opened", "cleaned", "moved", "fixed", "sold", "bought", "saw")
PREPOSITIONS = ("near", "behind", "inside", "under", "next to")
FRUITS = ("apples", "pears", "eggs", "lemons", "onions", "carrots", "plums", "rolls")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


class _Pick:
    """Uniform choices built on `random()` alone (the reproducible part of Python's generator)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)

    def below(self, n: int) -> int:
        return min(int(self._rng.random() * n), n - 1)

    def choice(self, seq):
        return seq[self.below(len(seq))]


@functools.lru_cache(maxsize=4)
def _people(seed: int) -> tuple[dict, ...]:
    """A fixed fact table: every name has one city, age, color, pet and pronoun for the whole corpus."""
    pick = _Pick(seed + 1)
    return tuple(dict(name=name, city=pick.choice(CITIES), age=18 + pick.below(60), color=pick.choice(COLORS),
                      pet=pick.choice(PETS), pronoun=pick.choice(("she", "he", "they")))
                 for name in NAMES)


def _story(pick: _Pick, people) -> str:
    person = pick.choice(people)
    name, pronoun = person["name"].capitalize(), person["pronoun"]
    article = "an" if person["color"][0] in "aeiou" else "a"
    lines = [f"{name} lives in {person['city']} and has {article} {person['color']} {person['pet']}."]
    for _ in range(2 + pick.below(4)):
        adjective, noun, verb = pick.choice(ADJECTIVES), pick.choice(NOUNS), pick.choice(VERBS)
        where = f"{pick.choice(PREPOSITIONS)} the {pick.choice(PLACES)}"
        lines.append(f"Then {pronoun} {verb} the {adjective} {noun} {where}.")
    lines.append(f"The {person['pet']} stayed home.")
    return " ".join(lines)


def _arithmetic(pick: _Pick) -> str:
    facts = []
    for _ in range(4 + pick.below(5)):
        a, b = pick.below(21), pick.below(21)
        op = pick.below(3)
        if op == 0:
            facts.append(f"{a} + {b} = {a + b}")
        elif op == 1:
            facts.append(f"{max(a, b)} - {min(a, b)} = {max(a, b) - min(a, b)}")
        else:
            facts.append(f"{a} * {b} = {a * b}")
    return "; ".join(facts) + "."


def _record(pick: _Pick, people) -> str:
    person = pick.choice(people)
    keys = ("name", "age", "city", "color", "pet")
    return "\n".join(f"{key}: {person[key]}" for key in keys)


def _counting(pick: _Pick) -> str:
    start, length = pick.below(90), 5 + pick.below(8)
    if pick.below(2):
        return f"counting from {start}: " + " ".join(str(start + i) for i in range(length)) + "."
    first = pick.below(len(NUMBER_WORDS) - 4)
    return "words: " + " ".join(NUMBER_WORDS[first:first + 4 + pick.below(len(NUMBER_WORDS) - first - 3)]) + "."


def _shopping(pick: _Pick, people) -> str:
    person = pick.choice(people)
    items = [f"{1 + pick.below(9)} {pick.choice(FRUITS)}" for _ in range(2 + pick.below(4))]
    return f"{person['name'].capitalize()} went to the market in {person['city']} and bought " + ", ".join(items) + "."


def generate_corpus(num_bytes: int = DEFAULT_BYTES, seed: int = DEFAULT_SEED) -> str:
    """ASCII text of at least `num_bytes` bytes, paragraphs separated by blank lines; a pure function."""
    pick, people = _Pick(seed), _people(seed)
    makers = (lambda: _story(pick, people), lambda: _arithmetic(pick), lambda: _record(pick, people),
              lambda: _counting(pick), lambda: _shopping(pick, people))
    parts, size = [], 0
    while size < num_bytes:
        paragraph = pick.choice(makers)() + "\n\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts)


@functools.lru_cache(maxsize=2)
def corpus_tokens(num_bytes: int = DEFAULT_BYTES, seed: int = DEFAULT_SEED) -> np.ndarray:
    """The corpus as byte-level token ids, uint8 [N], read-only."""
    tokens = np.frombuffer(generate_corpus(num_bytes, seed).encode("ascii"), dtype=np.uint8)
    tokens.flags.writeable = False
    return tokens
