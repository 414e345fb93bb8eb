"""What the bench says to the model: chat questions, a pasted text with its follow-ups, a long system prompt.
Fixed text, so every run and every system gets the same prompts."""


# Natural chat questions: short and long answers mixed, so replies end at their own EOS at different times.
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion simply.",
    "List three fruits that are rich in vitamin C.",
    "Why is the sky blue?",
    "Give me a tip for sleeping better.",
    "What is 12 times 7?",
    "Name a famous painter and one of their works.",
    "How do I boil an egg?",
    "What does a CPU do?",
    "Suggest a name for a grey cat.",
    "How can I learn to play the guitar?",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish.",
    "Why do leaves change color in autumn?",
    "Give me an idea for a quick vegetarian dinner.",
]

# The single-conversation scenario: questions that get a paragraph-long answer (decode speed needs tokens).
SINGLE_QUESTIONS = [
    "Explain how a refrigerator keeps food cold.",
    "Describe the water cycle in a few sentences.",
    "What are the benefits of regular exercise?",
    "How does a bicycle stay upright when it moves?",
]

# Background tabs in the interference scenario: prompts that get long replies.
LONG_REPLY_PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Write a detailed essay on the history of the printing press.",
    "Explain in detail, step by step, how the internet delivers a web page.",
    "Write a long letter to a friend describing a hiking trip in the mountains.",
    "Describe in detail the life cycle of a star, from nebula to its end.",
    "Write a long fairy tale about a dragon who is afraid of fire.",
    "Explain in detail how vaccines train the immune system.",
    "Write a detailed guide to growing tomatoes in a small garden.",
]
PROBE_QUESTION = "What is the boiling point of water at sea level?"
WARMUP_QUESTION = "Hello! Say hi back."

DOCUMENT = (
    "Honey bees live in colonies of up to sixty thousand individuals. Each colony has a single queen, a few "
    "hundred male drones and thousands of female worker bees. The queen lays up to two thousand eggs a day in "
    "the wax cells of the comb. Drones exist only to mate with queens from other colonies, and they are driven "
    "out of the hive before winter. Workers do everything else: young workers clean cells, feed the larvae with "
    "royal jelly and pollen, build comb from wax they secrete, and guard the entrance. Older workers become "
    "foragers. A forager that finds a rich patch of flowers returns to the hive and performs a waggle dance: "
    "the angle of the dance relative to vertical tells the others the direction of the flowers relative to the "
    "sun, and the length of the waggle run tells them the distance. Foragers collect nectar, which they store "
    "in a special honey stomach. Back in the hive, they pass it to house bees, who add enzymes and spread it "
    "in cells, fanning their wings until most of the water evaporates. When the honey is thick enough, they "
    "seal the cell with a wax cap. A strong colony can store more than fifty kilograms of honey in a good year, "
    "which feeds it through the winter, when the bees cluster together and shiver their flight muscles to keep "
    "the queen warm. Today colonies face many threats: the varroa mite, pesticides, the loss of wildflowers, "
    "and a changing climate.\n\n"
    "A colony reproduces by swarming. In late spring, when the hive grows crowded, the workers raise several "
    "new queens in large, peanut-shaped cells. Shortly before the first of them emerges, the old queen leaves "
    "with about half of the workers. The swarm settles on a branch while scouts search for a new home, such as "
    "a hollow tree. Each scout that finds a promising cavity dances for it, and the others visit the site and "
    "dance in turn when they approve of it. When enough scouts gather at one site, the swarm lifts off and "
    "flies there together. Back in the old hive, the first new queen to emerge usually kills her rivals in "
    "their cells. A few days later she flies out to mate with a dozen or more drones high in the air, storing "
    "their sperm for the rest of her life, which can last three to five years. A worker lives only five or six "
    "weeks in summer, worn out by foraging, but workers born in autumn can live for several months. Beekeepers "
    "work with these habits: they give colonies room to prevent swarming, check the combs for disease, treat "
    "against mites, and take only the honey that the bees will not need for the winter."
)
FIRST_TURN = "Read this text, then summarize it in two sentences.\n\n" + DOCUMENT
FOLLOW_UPS = [
    "What is the main job of the worker bees?",
    "Explain the waggle dance in more detail.",
    "How exactly do bees turn nectar into honey? Go step by step.",
    "Why are drones driven out before winter?",
    "What threats do bee colonies face today, and why do they matter?",
    "What can a gardener do to help bees? Give several ideas.",
    "Write a short poem about a forager bee.",
    "Summarize our whole conversation in a few bullet points.",
    "Give me three quiz questions about bees, with answers.",
]

SYSTEM_PROMPT = (
    "You are Juniper, the customer support assistant of Northwind Outdoor Gear, an online shop that sells "
    "tents, sleeping bags, backpacks, hiking boots, climbing equipment and camping stoves. Follow these rules "
    "in every answer. Be friendly, concise and precise; answer in the customer's language. Never invent order "
    "numbers, prices, stock levels or delivery dates: when you do not know, say so and offer to connect the "
    "customer with a human agent. Our opening hours are Monday to Friday, 8 am to 6 pm, and Saturday, 9 am to "
    "1 pm, Central European Time. Shipping: orders above 50 euros ship free within the European Union; smaller "
    "orders cost 4.90 euros. Standard delivery takes two to four working days; express delivery takes one "
    "working day and costs 9.90 euros. We do not ship gas canisters by air. Returns: customers may return "
    "unused items within 30 days of delivery for a full refund; used items can be returned only when they are "
    "defective. Refunds are paid to the original payment method within five working days after we receive "
    "the parcel. Warranty: two years on all products, five years on our own Northwind tents and backpacks. "
    "Sizing: hiking boots run half a size small, so advise customers to order half a size up; sleeping bags "
    "list a comfort temperature and a limit temperature, and customers should choose by the comfort one. "
    "Safety: never advise using a camping stove inside a closed tent; always mention ventilation when stoves "
    "or heaters come up. Loyalty program: members collect one point per euro spent and get a ten euro voucher "
    "for every 200 points. Privacy: never ask for full card numbers or passwords. If a customer is angry, "
    "acknowledge the problem first, then offer a concrete next step. Keep answers under 120 words unless the "
    "customer asks for detail, and end with a short question when it helps the customer move forward."
)
SHARED_PREFIX_QUESTIONS = [
    "Do you ship to Norway?",
    "My boots feel tight. What size should I order?",
    "Can I return a tent I slept in once?",
    "Which sleeping bag is good for zero degrees?",
    "How long is the warranty on your backpacks?",
    "Is it safe to cook inside my tent when it rains?",
    "When are you open on Saturday?",
    "How do loyalty points work?",
    "My order is late. What can I do?",
    "Do you sell climbing ropes?",
]

# The speculative scenario: prompts whose answer quotes the prompt (the tokens speculation can propose from
# the conversation), and open-ended ones (where it has little to propose, and must not slow anything).
GROUNDED_PROMPTS = [
    "Fix the typos in this paragraph and write the whole paragraph out again:\n\n"
    "Teh quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was verry happy. The dog, "
    "however, was not amused, and it barked loudly at the fox untill it ran away into the forrest.",
    "Rename the variable `result` to `total` in this code and show the whole function:\n\n"
    "def price(items):\n    result = 0\n    for item in items:\n        result = result + item.price * item.count\n"
    "    return result\n",
    "Reformat this list as a numbered list, one item per line, keeping every word:\n\n"
    "apples, green pears, three ripe bananas, a bag of oranges, fresh strawberries, two lemons, a melon",
]
OPEN_PROMPTS = [
    "Tell me about the history of the bicycle.",
    "What makes a good friend?",
    "Describe a walk through a forest in autumn.",
]
