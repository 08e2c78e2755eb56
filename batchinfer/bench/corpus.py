"""Documents of English-like prose for `bench job`: deterministic, any number, any length.

Not random token ids: sentences built from common words, names, places, dates and amounts, with
punctuation and paragraphs, so that a real BPE tokenizer splits them as it splits prose (about 4-5
characters a token with the Qwen vocabulary) and the job's tokenisation, prompt rendering and
detokenisation cost what they cost on real documents. Document i depends only on (seed, i), so any
shard can be rebuilt on its own and the same arguments always give the same files.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

CHARS_PER_TOKEN = 4.2  # this generator's text under the Qwen vocabulary (measured); sizes are approximate

_NOUNS = """account agreement amount analysis answer approach area article aspect assessment audit balance bank basis
board budget building business campaign capacity case category centre change chapter charge claim client code
colleague committee community company comparison condition contract control cost council county customer data
deadline decision delivery department deposit design detail development device director discussion district
document draft effect effort element employee energy engine equipment estimate event evidence example exchange
facility factor feature figure file finance firm focus forecast framework fund growth guidance history holder
improvement incident income increase industry information initiative insurance interest invoice issue item
journey knowledge labour land layer lease letter level licence limit line loan location machine manager market
material matter measure meeting member method model month network notice number objective office operation
option order organisation outcome output owner package page panel partner payment period permit plan platform
policy portfolio position practice premium price priority problem procedure process product programme project
property proposal provider purchase quality quarter question rate record reduction region register regulation
relationship release report request requirement research reserve resource response result revenue review risk
route rule safety sale sample schedule scheme school section sector service session settlement share shipment
site skill software solution source standard statement station status step stock strategy structure study
subject supplier supply support survey system target task team technology term test text time tool total trade
training transaction transfer transport trend unit update user value vehicle vendor version volume warehouse
week window worker year""".split()
_VERBS_PAST = """accepted achieved added adjusted agreed allocated announced approved arranged assessed assigned
balanced booked calculated cancelled changed checked cleared closed collected completed confirmed considered
covered created decided declined defined delayed delivered described designed determined developed discussed
doubled earned entered established estimated examined exceeded expanded explained extended filed finished fixed
followed forecast found granted handled identified improved included increased informed installed issued joined
launched limited listed maintained managed marked measured merged moved noted observed offered opened ordered
organised paid passed placed planned posted prepared presented priced processed produced proposed provided
published raised reached received recorded reduced referred registered rejected released removed renewed
reported requested required reserved resolved reviewed revised scheduled secured selected sent settled shared
shipped signed simplified sold started stated submitted supported tested tracked transferred updated used
verified visited""".split()
_VERBS = """accept add adjust agree allow approve arrange assess build calculate change check close collect complete
confirm consider continue cover create deliver describe develop discuss ensure estimate expand explain extend
finish follow improve include increase inform maintain manage measure meet move offer open order organise pay
plan prepare present process produce provide publish raise reach receive record reduce register release remove
renew replace report request require resolve review revise schedule secure select send settle share ship sign
start submit supply support test track transfer update use verify""".split()
_ADJECTIVES = """annual available basic brief central clear common complete current daily detailed direct early
effective efficient entire essential existing expected external final financial formal former full general
global good high important initial internal key large late likely local long low main major minor monthly
national necessary net new normal official open operational original overall particular permanent personal
possible potential practical previous primary principal private proper public quarterly quick recent regional
regular relevant remaining reasonable responsible revised short significant similar simple single small special
specific stable standard strong substantial successful suitable technical temporary total typical usual
valuable various weekly whole wide""".split()
_ADVERBS = """already also briefly carefully clearly currently directly early easily eventually finally firmly
formally fully generally gradually immediately largely later mainly nearly normally now officially only partly
previously promptly quickly rarely recently regularly roughly shortly significantly simply slightly soon still
strongly successfully typically usually widely""".split()
_NAMES = """Alice Amara Anna Ben Carlos Chen Clara Daniel David Elena Emma Fatima Felix Grace Hannah Hiro Isabel
Ivan James Julia Kai Laura Leila Lucas Maria Marta Maya Mohammed Nina Noah Olivia Omar Paul Priya Rosa Sam Sara
Sofia Tom Yara Zoe""".split()
_SURNAMES = """Adams Alvarez Bauer Becker Brown Castro Chen Clarke Cohen Costa Davies Dubois Evans Fischer Garcia
Hansen Ito Jensen Khan Kowalski Lee Lopez Martin Meyer Moreau Muller Nakamura Novak Okafor Patel Rossi Schmidt
Silva Singh Smith Tanaka Taylor Walker Weber Wilson Wright Young""".split()
_CITIES = """Amsterdam Athens Barcelona Berlin Boston Brussels Cairo Chicago Dublin Edinburgh Geneva Hamburg Helsinki
Istanbul Lagos Lisbon London Lyon Madrid Manchester Milan Montreal Munich Nairobi Oslo Paris Porto Prague Rome
Rotterdam Seattle Seoul Singapore Stockholm Sydney Tokyo Toronto Valencia Vienna Warsaw Zurich""".split()
_COMPANY_A = """Apex Atlas Beacon Blue Cedar Crest Delta Eagle Evergreen Falcon Granite Harbor Horizon Iron Lakeside
Maple Meridian North Oak Orbit Pacific Pioneer Summit Silver Sterling Unity Vertex Westfield""".split()
_COMPANY_B = """Analytics Capital Consulting Devices Energy Foods Freight Group Health Holdings Industries Labs
Logistics Media Metals Partners Pharma Systems Technologies Textiles Trading""".split()
_MONTHS = """January February March April May June July August September October November December""".split()
_PREPS = """across after against around at before behind below beside between by during for from in inside into
near of on outside over through to toward under within without""".split()
_KINDS = ("report", "memo", "invoice", "letter", "minutes", "notice", "proposal", "summary")
_CONNECT = ("However", "In addition", "As a result", "Meanwhile", "For this reason", "In practice", "At the same time",
            "According to the team", "By contrast", "In the meantime", "Overall", "Later that week")


@dataclass(frozen=True)
class CorpusSpec:
    """How many documents, in how many Parquet shards, of what length (tokens, approximate), from which seed."""

    docs: int = 2000
    shards: int = 4
    min_tokens: int = 500
    max_tokens: int = 3000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.docs < 1 or self.shards < 1:
            raise ValueError("--docs and --shards must be at least 1")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= --min-tokens <= --max-tokens, not {self.min_tokens} and {self.max_tokens}")

    def key(self) -> str:
        """A short name for these arguments (the corpus's cache folder)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


class _Writer:
    """Sentences for one document (its own random stream)."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng
        self.company = f"{rng.choice(_COMPANY_A)} {rng.choice(_COMPANY_B)}"
        self.city = rng.choice(_CITIES)
        self.person = f"{rng.choice(_NAMES)} {rng.choice(_SURNAMES)}"
        self.topic = [rng.choice(_NOUNS) for _ in range(4)]

    def noun(self) -> str:
        # a document keeps coming back to its own topics, as real ones do
        return self.r.choice(self.topic) if self.r.random() < 0.3 else self.r.choice(_NOUNS)

    def nouns(self) -> str:
        n = self.noun()
        return n[:-1] + "ies" if n.endswith("y") and n[-2] not in "aeiou" else n + ("es" if n.endswith(("s", "x", "ch", "sh")) else "s")

    def date(self) -> str:
        r = self.r
        return f"{r.randint(1, 28)} {r.choice(_MONTHS)} {r.randint(2015, 2026)}"

    def amount(self) -> str:
        r = self.r
        cur = r.choice(("EUR ", "USD ", "GBP ", "$", "€"))
        return f"{cur}{r.randint(1, 999):,}{r.choice(('', ',000', '.50', '.00', ',250'))}"

    def name(self) -> str:
        return self.person if self.r.random() < 0.4 else f"{self.r.choice(_NAMES)} {self.r.choice(_SURNAMES)}"

    def sentence(self) -> str:
        r = self.r
        a, adv = r.choice(_ADJECTIVES), r.choice(_ADVERBS)
        pick = r.randrange(12)
        if pick == 0:
            s = f"The {a} {self.noun()} {r.choice(_VERBS_PAST)} the {self.noun()} {r.choice(_PREPS)} the {self.noun()}."
        elif pick == 1:
            s = f"{self.name()} said that the {self.noun()} would {r.choice(_VERBS)} {adv} by {self.date()}."
        elif pick == 2:
            s = (f"In {r.randint(2015, 2026)}, {self.company} {r.choice(_VERBS_PAST)} {r.randint(2, 480)} {self.nouns()} "
                 f"in {r.choice(_CITIES)}, and the {a} {self.noun()} {r.choice(_VERBS_PAST)} {adv}.")
        elif pick == 3:
            s = f"The total {self.noun()} of {self.amount()} was {r.choice(_VERBS_PAST)} on {self.date()}."
        elif pick == 4:
            s = (f"{r.choice(_CONNECT)}, the team {r.choice(_VERBS_PAST)} a {a} {self.noun()} and "
                 f"{r.choice(_VERBS_PAST)} the {r.choice(_ADJECTIVES)} {self.noun()}.")
        elif pick == 5:
            s = f"Can the {self.noun()} {r.choice(_VERBS)} the {a} {self.noun()} before the {self.noun()} review?"
        elif pick == 6:
            s = (f"About {r.randint(3, 97)}% of the {self.nouns()} were {r.choice(_VERBS_PAST)} {adv}, "
                 f"compared with {r.randint(3, 97)}% a year earlier.")
        elif pick == 7:
            s = f"Please {r.choice(_VERBS)} the {a} {self.noun()} and send it to {self.name()} in {self.city}."
        elif pick == 8:
            items = ", ".join(self.noun() for _ in range(r.randint(2, 4)))
            s = f"The {self.noun()} covers {items} and the {r.choice(_ADJECTIVES)} {self.noun()}."
        elif pick == 9:
            s = (f"Reference {r.choice('ABCDEFGHJK')}{r.randint(100, 9999)}-{r.randint(10, 99)} was "
                 f"{r.choice(_VERBS_PAST)} by the {self.noun()} {self.noun()} on {self.date()}.")
        elif pick == 10:
            s = (f"{self.company} {adv} {r.choice(_VERBS_PAST)} its {a} {self.noun()}, which "
                 f"{r.choice(_VERBS_PAST)} {r.choice(_PREPS)} the {self.noun()}.")
        else:
            s = f"\"We {r.choice(_VERBS_PAST)} the {self.noun()} {adv},\" {self.name()} noted."
        return s

    def title(self) -> str:
        r = self.r
        words = [r.choice(_ADJECTIVES), self.noun(), r.choice(_KINDS)]
        return f"{self.company}: " + " ".join(w.capitalize() for w in words) + f" ({r.choice(_MONTHS)} {r.randint(2015, 2026)})"


def document(seed: int, i: int, tokens: int) -> tuple[str, str]:
    """(title, text) of document i: paragraphs of prose of about `tokens` tokens."""
    rng = random.Random(f"{seed}:{i}")
    w = _Writer(rng)
    title = w.title()
    want = int(tokens * CHARS_PER_TOKEN)
    paras: list[str] = [f"{w.city}, {w.date()}", f"From: {w.person}, {w.company}"]
    size = sum(len(p) for p in paras)
    while size < want:
        para = " ".join(w.sentence() for _ in range(rng.randint(3, 7)))
        paras.append(para)
        size += len(para) + 2
    return title, "\n\n".join(paras)


def write_corpus(spec: CorpusSpec, folder: str | Path) -> list[Path]:
    """Write the corpus as `shard-NNN.parquet` files (columns doc_id, title, text) into folder; returns their paths.

    A folder that already holds this corpus (same arguments; a `_corpus.json` written last) is reused.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(folder)
    marker = out / "_corpus.json"
    paths = [out / f"shard-{k:03d}.parquet" for k in range(spec.shards)]
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec) and all(p.exists() for p in paths):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    lengths = random.Random(spec.seed)
    sizes = [lengths.randint(spec.min_tokens, spec.max_tokens) for _ in range(spec.docs)]
    for k, path in enumerate(paths):
        idx = range(k, spec.docs, spec.shards)  # documents dealt round-robin over the shards
        rows = [document(spec.seed, i, sizes[i]) for i in idx]
        table = pa.table({"doc_id": [f"doc-{i:07d}" for i in idx], "title": [t for t, _ in rows], "text": [x for _, x in rows]})
        pq.write_table(table, path, compression="zstd")
    marker.write_text(json.dumps(asdict(spec)))
    return paths
