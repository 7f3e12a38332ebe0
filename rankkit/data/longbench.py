"""LongBench (v1 and LongBench-E) records: its prompts, its metric per dataset, its generation lengths.

A record has ``_id, context, input, answers, dataset`` (and ``all_classes``,
``length``, ``language``). Its prompt template (LongBench's ``dataset2prompt``) is
split around ``{context}`` into the example's preamble and question.
"""

from __future__ import annotations

from rankkit.data.example import Example
from rankkit.errors import RankkitError

_QA_PASSAGES = "Answer the question based on the given passages. Only give me the answer and do not output any other words."

PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": f"{_QA_PASSAGES}\n\nThe following are given passages.\n{{context}}\n\n{_QA_PASSAGES}\n\nQuestion: {{input}}\nAnswer:",
    "2wikimqa": f"{_QA_PASSAGES}\n\nThe following are given passages.\n{{context}}\n\n{_QA_PASSAGES}\n\nQuestion: {{input}}\nAnswer:",
    "musique": f"{_QA_PASSAGES}\n\nThe following are given passages.\n{{context}}\n\n{_QA_PASSAGES}\n\nQuestion: {{input}}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# LongBench's dataset2metric, with rankkit's metric names
METRIC_OF_DATASET = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_l_zh",
    "gov_report": "rouge_l",
    "qmsum": "rouge_l",
    "multi_news": "rouge_l",
    "vcsum": "rouge_l_zh",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge_l",
    "lsht": "classification",
    "passage_retrieval_en": "retrieval",
    "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

# LongBench's dataset2maxlen: how many tokens it lets the model generate
TOKENS_TO_GENERATE = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# LongBench scores only the first line of the prediction on its few-shot datasets...
FIRST_LINE_DATASETS = {"trec", "triviaqa", "samsum", "lsht"}
# ...and prompts these without the chat template
NO_CHAT_TEMPLATE_DATASETS = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}


def is_longbench_record(record: dict) -> bool:
    return "input" in record and "_id" in record


def dataset_name(name: str, where: str) -> str:
    """The LongBench dataset a record belongs to (LongBench-E's names end in ``_e``)."""
    if name in PROMPTS:
        return name
    if name.endswith("_e") and name[:-2] in PROMPTS:
        return name[:-2]
    raise RankkitError(f"{where}: unknown LongBench dataset '{name}'; known: {', '.join(PROMPTS)}")


def longbench_example(record: dict, where: str) -> Example:
    missing = [key for key in ("_id", "context", "input", "answers", "dataset") if key not in record]
    if missing:
        raise RankkitError(f"{where}: a LongBench record needs {', '.join(missing)}")
    dataset = dataset_name(record["dataset"], where)
    before, after = PROMPTS[dataset].split("{context}")
    meta = {
        "dataset": record["dataset"],
        "tokens_to_generate": TOKENS_TO_GENERATE[dataset],
        "all_classes": list(record.get("all_classes") or []),
    }
    for key in ("length", "language"):
        if key in record:
            meta[key] = record[key]
    if dataset in FIRST_LINE_DATASETS:
        meta["first_line_only"] = True
    if dataset in NO_CHAT_TEMPLATE_DATASETS:
        meta["use_chat_template"] = False
    answers = record["answers"]
    return Example(
        id=str(record["_id"]),
        task=f"longbench/{dataset}",
        preamble=before,
        context=record["context"],
        question=after.lstrip("\n").replace("{input}", record["input"]),
        answers=(answers,) if isinstance(answers, str) else tuple(answers),
        metric=METRIC_OF_DATASET[dataset],
        meta=meta,
    )
